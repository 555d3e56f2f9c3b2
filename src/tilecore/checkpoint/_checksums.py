"""Checksums of a checkpoint's arrays: recorded by `save`, compared by every read.

Orbax stores arrays through TensorStore, which keeps no checksum of the values: a
flipped byte in an uncompressed chunk reads back as another number, with no error.
So `save` records a checksum of every array's bytes (with its dtype and shape) in the
checkpoint's JSON metadata, under `"checksums"`, and every read recomputes it.

The metadata itself is sealed the same way (`SEAL`: a CRC-32 of the rest of the
record), so an edited or bit-flipped value there is caught too, even in fields a
restore does not use.

Checksums cover the whole logical array, never one shard, so they hold whatever
topology (device count, mesh, process count) writes or reads the checkpoint. A
record names its algorithm by its key:

- `"crc32"`: the CRC-32 of the array gathered to the host (C order, little-endian);
  every array this process can gather whole (single-process jobs).
- `"hashsum64"` (`_hashsum`): a sum over elements of a hash of each element's index
  and bytes, which each process takes over the shards it holds and the processes
  add (a collective): the arrays of a multi-process job no process can gather (a
  row-sharded table). A read of such an array onto shards combines the processes'
  sums the same way before comparing, so every process raises the same error.
  A `"crc32"` record cannot be taken from shards: an array it describes that is read
  onto the devices of several processes (an `extra` leaf saved by one process,
  restored by several) is brought whole to every process first — from this
  process's copy when its shards hold the whole array (replicated), else gathered
  from every process (a collective, as `"hashsum64"`'s sum is).

Checkpoints written before checksums existed are read unchecked (shapes only).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ._hashsum import hashsum64, local_sum, process_sums

ALGORITHM = "crc32"
"""The `"algorithm"` of the `"checksums"` entry: records are `CRC32` ones unless
they say otherwise (`HASHSUM64`)."""
CRC32, HASHSUM64 = "crc32", "hashsum64"
SEAL = "metadata_crc32"
Checksum = dict[str, Any]
"""`{"crc32" or "hashsum64": int, "dtype": str, "shape": [int, ...]}` of one array."""


class _Part(int):
    """This process's part of a `"hashsum64"` record, until `saved_checksums` adds
    the processes' parts."""


def _spans_processes(value: Any) -> bool:
    return isinstance(value, jax.Array) and not value.is_fully_addressable


class Expected(NamedTuple):
    """What one saved array must be, for checking it as it is read.

    Attributes:
      name: how messages name it (stack and table/slot, or the extra leaf's path).
      checksum: as recorded by `save` (None: not recorded; only the shape is checked).
      shape: the shape the layout demands (None: any).
      strict: a dtype or shape other than the recorded one means damage. False for
        `extra` leaves, where a restore target may ask for another dtype (a cast):
        such leaves are not compared.
    """

    name: str
    checksum: Checksum | None = None
    shape: tuple[int, ...] | None = None
    strict: bool = True


def _entry(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_key(path: Sequence[Any]) -> str:
    """A leaf's path as `a/b/0`: the same for a tree as saved (named tuples, tuples)
    and as Orbax gives it back without a target (dicts keyed by field, lists)."""
    return "/".join(_entry(e) for e in path)


def _numeric(value: Any) -> np.ndarray | None:
    """`value` as a numpy array, or None for a leaf that is not numeric data (an opaque
    object, or an object array): nothing to checksum."""
    try:
        array = np.asarray(value)
    except Exception:
        return None
    return None if array.dtype.hasobject else array


def checksum(value: Any) -> Checksum | None:
    """CRC-32 of `value`'s bytes (little-endian, C order), with dtype and shape.

    A jax array this process cannot gather whole gets this process's part of its
    `"hashsum64"` instead (`saved_checksums` adds the processes' parts). None when
    there is nothing to compare: a leaf that is not numeric data.
    """
    if _spans_processes(value):
        return {HASHSUM64: _Part(local_sum(value)), "dtype": str(value.dtype),
                "shape": list(value.shape)}
    array = _numeric(value)
    if array is None:
        return None
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return {"crc32": zlib.crc32(data.data), "dtype": str(array.dtype), "shape": list(array.shape)}


def embedding_checksums(order: Sequence[str], slot_names: Mapping[str, Sequence[str]],
                        variables: Mapping[str, Any]) -> dict[str, Any]:
    """Stack → `{"table": checksum, "slots": {slot name: checksum}}` of each stack's
    `EmbeddingVariables` (`.table`, `.slots`), as JSON."""
    return {s: {"table": checksum(variables[s].table),
                "slots": {name: checksum(v) for name, v in
                          zip(slot_names[s], variables[s].slots, strict=True)}}
            for s in order}


def extra_checksums(extra: Any) -> dict[str, Checksum | None]:
    """Leaf path (`leaf_key`) → checksum of every leaf of the `extra` pytree.

    Paths that two leaves share once written as strings get None (not compared).
    """
    out: dict[str, Checksum | None] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(extra)[0]:
        key = leaf_key(path)
        out[key] = None if key in out else checksum(leaf)
    return out


def _algorithm(record: Mapping[str, Any]) -> str:
    return HASHSUM64 if HASHSUM64 in record else CRC32


def _value(record: Checksum) -> str:
    algorithm = _algorithm(record)
    return f"{algorithm} {record[algorithm]:#0{10 if algorithm == CRC32 else 18}x}"


def _describe(record: Checksum) -> str:
    return f"{_value(record)}, {record['dtype']} {tuple(record['shape'])}"


def _whole(value: jax.Array) -> np.ndarray:
    """All of an array spread over processes, on this host: a shard of this process
    that holds all of it (a replicated array), else gathered from every process (a
    collective: the shards are alike on every process, so every process takes the
    same branch)."""
    for shard in value.addressable_shards:
        if shard.data.shape == value.shape:
            return np.asarray(shard.data)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def _measure(value: Any, want: Checksum) -> Checksum | None:
    """`value`'s checksum by `want`'s algorithm (None: not numeric). For an array
    spread over processes both are collectives: every process measures it, or none."""
    if _spans_processes(value):
        if _algorithm(want) == CRC32:
            if (str(value.dtype), list(value.shape)) != (want["dtype"], list(want["shape"])):
                return {"dtype": str(value.dtype), "shape": list(value.shape)}
            return checksum(_whole(value))
        kind: dict[str, Any] = {"dtype": str(value.dtype), "shape": list(value.shape)}
    else:
        array = _numeric(value)
        if array is None:
            return None
        if _algorithm(want) == CRC32:
            return checksum(array)
        kind, value = {"dtype": str(array.dtype), "shape": list(array.shape)}, array
    if (kind["dtype"], kind["shape"]) != (want["dtype"], list(want["shape"])):
        return kind  # not the saved array: compared no further
    return {HASHSUM64: hashsum64(value), **kind}


def problem(expected: Expected, value: Any) -> str | None:
    """Why `value` is not the array `expected` describes (None: it is, or unknown)."""
    if expected.shape is not None and tuple(np.shape(value)) != expected.shape:
        return (f"it has shape {tuple(np.shape(value))} but the saved layout says "
                f"{expected.shape}")
    want = expected.checksum
    if want is None:
        return None
    got = _measure(value, want)
    if got is None:
        return None
    if (got["dtype"], got["shape"]) != (want["dtype"], list(want["shape"])):
        if not expected.strict:
            return None  # read as another dtype/shape on request: not comparable
        return (f"it reads as {got['dtype']} {tuple(got['shape'])}, but was saved as "
                f"{_describe(want)}")
    if got[_algorithm(want)] != want[_algorithm(want)]:
        return (f"its bytes changed after saving: it reads as {_value(got)}, but save "
                f"recorded {_value(want)}")
    return None


def check_record(record: Any) -> Checksum | None:
    """`record` as a checksum (None stays None); raises ValueError if malformed."""
    if record is None:
        return None
    if (not isinstance(record, Mapping)
            or not isinstance(record.get(_algorithm(record)), int)
            or not isinstance(record.get("dtype"), str)
            or not isinstance(record.get("shape"), list)):
        raise ValueError(f"checksum record {record!r} is malformed")
    return dict(record)


def _records(tree: Any) -> list[Checksum]:
    """Every checksum record in `tree` (nested dicts), in order."""
    if not isinstance(tree, dict):
        return []
    if isinstance(tree.get("dtype"), str):
        return [tree]
    return [r for value in tree.values() for r in _records(value)]


def saved_checksums(embeddings: dict[str, Any], extra: dict[str, Checksum | None] | None
                    ) -> dict[str, Any]:
    """The metadata's `"checksums"` entry, each process's parts of `"hashsum64"`
    records added over processes (a collective when there are any: every process
    saves the same arrays)."""
    parts = [r for r in _records({"e": embeddings, "x": extra})
             if isinstance(r.get(HASHSUM64), _Part)]
    for record, total in zip(parts, process_sums([r[HASHSUM64] for r in parts]), strict=True):
        record[HASHSUM64] = total
    return {"algorithm": ALGORITHM, "embeddings": embeddings, "extra": extra}


def expectations(record: Any, stacks: Mapping[str, tuple[int, int, tuple[str, ...]]],
                 slot_names: Mapping[str, Sequence[str]]
                 ) -> tuple[dict[str, Expected], dict[str, Expected]]:
    """What every `embeddings` array and `extra` leaf must be, by `leaf_key`.

    Args:
      record: the metadata's `"checksums"` (None: a checkpoint from before them,
        whose arrays are checked for their shapes only).
      stacks: stack → (vocab size, embedding dim, table names), in array order.
      slot_names: stack → its slot names, in array order.

    Raises:
      KeyError, TypeError, ValueError: `record` is malformed.
    """
    if record is not None:
        if not isinstance(record, Mapping) or record.get("algorithm") != ALGORITHM:
            raise ValueError(f"checksums {str(record)[:200]} are not {ALGORITHM} records")
        saved, extra = record["embeddings"], record["extra"]
    else:
        saved, extra = None, None
    embeddings: dict[str, Expected] = {}
    for i, (stack, (vocab, dim, tables)) in enumerate(stacks.items()):
        where, shape = f"stack {stack!r} (tables {list(tables)})", (vocab, dim)
        entry = None if saved is None else saved[stack]
        embeddings[f"{i}/table"] = Expected(
            f"{where} table", None if entry is None else check_record(entry["table"]), shape)
        for j, slot in enumerate(slot_names[stack]):
            embeddings[f"{i}/slots/{j}"] = Expected(
                f"{where} slot {slot!r}",
                None if entry is None else check_record(entry["slots"][slot]), shape)
    leaves = {} if extra is None else {
        str(key): Expected(f"extra leaf {key!r}", check_record(value), strict=False)
        for key, value in dict(extra).items()}
    return embeddings, leaves


def _record_crc(record: Mapping[str, Any]) -> int:
    text = json.dumps({k: v for k, v in record.items() if k != SEAL}, sort_keys=True,
                      separators=(",", ":"))
    return zlib.crc32(text.encode())


def seal(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with `SEAL`, the CRC-32 of its canonical JSON (left out if it has none)."""
    try:
        return {**record, SEAL: _record_crc(record)}
    except (TypeError, ValueError):  # not canonical JSON (mixed key types): unsealed
        return record


def seal_problem(record: Mapping[str, Any]) -> str | None:
    """Why `record` is not the one `seal` wrote (None: it is, or it was never sealed)."""
    if SEAL not in record:
        return None
    got = _record_crc(record)
    if got != record[SEAL]:
        return (f"its values changed after saving: they read as crc32 {got:#010x}, but save "
                f"recorded {record[SEAL]!r}")
    return None
