"""The reference's compact mod-sharded table layout, read off tilecore's stacking plan.

`utils.shard_emb_table` lays a `[vocab, ...]` table out as
`[num_devices, num_sc_per_device · vocab / N, ...]` (N = devices × SparseCores):
logical row `i` goes to partition `i mod N`, row `i div N` of that partition's
block. That is tilecore's own placement of a lone table in a stack
(`tilecore.stacking.physical_rows`), without the padding rows that the stack adds
to reach a multiple of `8·N`. The rows are computed from a one-table native plan
so that both layouts stay one rule.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import specs as native
from ..specs._numbers import is_integer
from ..stacking import physical_rows, plan_stacking

_TABLE = "table"


def _check_counts(what: str, vocab_size: int, num_devices: int, num_sc_per_device: int) -> int:
    """N = num_devices × num_sc_per_device, after checking the counts and `vocab_size`."""
    for name, value in (("num_devices", num_devices), ("num_sc_per_device", num_sc_per_device)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{what}: {name} must be an integer >= 1, got {value!r}.")
    partitions = int(num_devices) * int(num_sc_per_device)
    if vocab_size < 1 or vocab_size % partitions:
        raise ValueError(
            f"{what}: the table has {vocab_size} rows, which do not split evenly over "
            f"{partitions} SparseCores (num_devices={num_devices} × num_sc_per_device="
            f"{num_sc_per_device}). Pad the table's rows to a multiple of {partitions}."
        )
    return partitions


@functools.lru_cache(maxsize=32)
def _compact_rows(vocab_size: int, num_devices: int, num_sc_per_device: int) -> np.ndarray:
    try:
        topology = native.Topology(global_devices=num_devices, sc_per_device=num_sc_per_device)
    except ValueError as err:
        raise ValueError(
            f"The mod-sharded layout of {num_devices} devices × {num_sc_per_device} SparseCores "
            f"is not one tilecore can run: {err}"
        ) from None
    partitions = num_devices * num_sc_per_device
    table = native.TableSpec(name=_TABLE, vocab_size=vocab_size, embedding_dim=1)
    feature = native.FeatureSpec(name=_TABLE, table=table, input_shape=(partitions, 1))
    plan = plan_stacking([feature], topology)
    rows_per_shard = plan.stacks[plan.feature_settings[_TABLE].stack_name].vocab_size // partitions
    physical = physical_rows(plan, _TABLE, np.arange(vocab_size, dtype=np.int64))
    rows = (physical // rows_per_shard) * (vocab_size // partitions) + physical % rows_per_shard
    rows.setflags(write=False)
    return rows


def compact_rows(what: str, vocab_size: int, num_devices: int, num_sc_per_device: int
                 ) -> np.ndarray:
    """Row of the flattened sharded table that holds each logical row `0..vocab_size-1`."""
    _check_counts(what, vocab_size, num_devices, num_sc_per_device)
    return _compact_rows(int(vocab_size), int(num_devices), int(num_sc_per_device))


@functools.lru_cache(maxsize=32)
def _inverse(vocab_size: int, num_devices: int, num_sc_per_device: int) -> np.ndarray:
    rows = _compact_rows(vocab_size, num_devices, num_sc_per_device)
    inverse = np.empty_like(rows)
    inverse[rows] = np.arange(vocab_size, dtype=rows.dtype)
    inverse.setflags(write=False)
    return inverse


def source_rows(what: str, vocab_size: int, num_devices: int, num_sc_per_device: int
                ) -> np.ndarray:
    """Logical row held by each row of the flattened sharded table (the inverse permutation)."""
    _check_counts(what, vocab_size, num_devices, num_sc_per_device)
    return _inverse(int(vocab_size), int(num_devices), int(num_sc_per_device))
