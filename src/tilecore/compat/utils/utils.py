"""The reference's SparseCore utilities (`jax_tpu_embedding.sparsecore.utils.utils`) on tilecore.

Port by changing the import to `from tilecore.compat.utils import utils`.

Differences worth knowing:
- `num_sparsecores_per_device` answers for any device: TPU kinds keep the
  reference's counts (`NUM_SC_PER_DEVICE_MAP`); a CPU or GPU device has tilecore's
  logical SparseCores per device (4, the rule `num_sc_per_device=None` follows
  everywhere in `tilecore.compat`). An unknown *TPU* kind still raises.
- `embedding_table_format*` return the plain sharding for every non-TPU device:
  tilecore's tables are ordinary row-major arrays that XLA reads with its default
  layout on CPU and GPU (the reference's `(8,)`-tiled `Format` exists only on
  TPU, where it is still returned).
- `shard_emb_table`/`unshard_emb_table` place rows with tilecore's mod-sharding
  rule (`tilecore.stacking.physical_rows`), so devices × SparseCores must be a
  topology tilecore runs (a power of two). They accept numpy and JAX arrays (also
  under `jit`) and keep the array's type and dtype.
"""

from __future__ import annotations

import typing

import jax
import numpy as np
from jax.experimental import layout

from .._native import resolve_num_sc_per_device
from .._utils_embedding import sharding_strategy_to_enum
from .._utils_estimate import estimate
from .._utils_layout import compact_rows, source_rows

Layout = layout.Layout

__all__ = [
    "NUM_SC_PER_DEVICE_MAP",
    "DeviceLike",
    "Layout",
    "MeshLike",
    "embedding_table_format",
    "embedding_table_format_with_sharding",
    "estimate_preprocessing_parameters",
    "num_sparsecores_per_device",
    "shard_emb_table",
    "unshard_emb_table",
]

_ArrayType = typing.TypeVar("_ArrayType", bound=jax.typing.ArrayLike)

NUM_SC_PER_DEVICE_MAP = {
    "TPU v5": 4,
    "TPU v5p": 4,
    "TPU v6e": 2,
    "TPU v6 lite": 2,
    "TPU7x": 2,
}
"""SparseCores per chip of each TPU device kind (as the reference lists them)."""


class DeviceLike(typing.Protocol):
    """Anything with a `device_kind` (a `jax.Device`, or a stand-in in tests)."""

    @property
    def device_kind(self) -> str: ...


MeshLike: typing.TypeAlias = jax.sharding.Mesh | jax.sharding.AbstractMesh


def _is_tpu_kind(device_kind: str) -> bool:
    return device_kind.upper().startswith("TPU")


def num_sparsecores_per_device(device: DeviceLike | None = None) -> int:
    """SparseCores per device: the TPU's count, or tilecore's logical default elsewhere.

    Args:
      device: the device to ask (None: `jax.devices()[0]`).

    Raises:
      ValueError: the device has no `device_kind`, or is a TPU (by kind or platform) of an
        unknown kind (the offline converter's `--target_device_kind=v6e` got 4 silently).
    """
    target = device or jax.devices()[0]
    if not hasattr(target, "device_kind"):
        raise ValueError(f"Cannot determine device kind for device: {target!r}")
    kind = target.device_kind
    if kind in NUM_SC_PER_DEVICE_MAP:
        return NUM_SC_PER_DEVICE_MAP[kind]
    if (not isinstance(kind, str) or _is_tpu_kind(kind)
            or getattr(target, "platform", None) == "tpu"):  # e.g. the converter's FakeDevice
        raise ValueError(
            f"Unknown sparsecore count for device kind: {kind!r}. Known device kinds: "
            f"{list(NUM_SC_PER_DEVICE_MAP)}; pass num_sc_per_device explicitly."
        )
    return resolve_num_sc_per_device(None)


def embedding_table_format(
    mesh: MeshLike, partition_spec: jax.sharding.PartitionSpec
) -> jax.sharding.Sharding | layout.Format:
    """The format (sharding, plus a layout on TPU) of tables split by `partition_spec`."""
    return embedding_table_format_with_sharding(jax.sharding.NamedSharding(mesh, partition_spec))


def embedding_table_format_with_sharding(
    sharding: jax.sharding.Sharding,
) -> jax.sharding.Sharding | layout.Format:
    """`sharding` itself off TPU; on TPU the reference's `(8,)`-tiled row-major `Format`."""
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        kind = getattr(mesh.abstract_device, "device_kind", "")
    else:
        devices = list(sharding.device_set)
        kind = getattr(devices[0], "device_kind", "") if devices else ""
    if not (isinstance(kind, str) and _is_tpu_kind(kind)):
        return sharding
    return layout.Format(Layout(major_to_minor=(0, 1), tiling=((8,),)), sharding)


def _as_array(value: typing.Any, what: str, min_ndim: int) -> typing.Any:
    array = value if isinstance(value, np.ndarray | jax.Array) else np.asarray(value)
    if array.ndim < min_ndim:
        raise ValueError(f"{what}: expected an array of rank >= {min_ndim}, got shape "
                         f"{tuple(array.shape)}.")
    return array


def shard_emb_table(
    table: _ArrayType,
    *,
    num_devices: int,
    num_sc_per_device: int,
    sharding_strategy: str = "MOD",
) -> _ArrayType:
    """`[vocab, ...]` → `[num_devices, num_sc_per_device · vocab / N, ...]`, mod-sharded.

    Row `i` goes to SparseCore `i mod N` (N = num_devices × num_sc_per_device) at
    row `i div N` of its block; `vocab` must be a multiple of N.
    """
    sharding_strategy_to_enum(sharding_strategy)
    array = _as_array(table, "shard_emb_table", 1)
    rows = source_rows("shard_emb_table", int(array.shape[0]), num_devices, num_sc_per_device)
    return array[rows].reshape(num_devices, -1, *array.shape[1:])  # type: ignore[return-value]


def unshard_emb_table(
    sharded_table: _ArrayType,
    num_sc_per_device: int,
    sharding_strategy: str = "MOD",
) -> _ArrayType:
    """The inverse of `shard_emb_table`: `[devices, S · vocab / N, ...]` → `[vocab, ...]`."""
    sharding_strategy_to_enum(sharding_strategy)
    array = _as_array(sharded_table, "unshard_emb_table", 2)
    devices, per_device = int(array.shape[0]), int(array.shape[1])
    vocab = devices * per_device
    rows = compact_rows("unshard_emb_table", vocab, devices, num_sc_per_device)
    return array.reshape(vocab, *array.shape[2:])[rows]  # type: ignore[return-value]


def estimate_preprocessing_parameters(
    *,
    global_batch_size: int,
    global_device_count: int,
    num_sc_per_device: int,
    valency: float,
    hot_shard_fraction: float = 0.20,
    headroom_factor: float = 1.25,
) -> dict[str, int]:
    """First guesses for `max_ids_per_partition`, `max_unique_ids_per_partition` and
    `suggested_coo_buffer_size_per_device` from the batch, devices and lookups per sample.

    `valency` is the mean lookups per sample over the stacked features;
    `hot_shard_fraction` the share of lookups assumed to land on the busiest
    SparseCore; `headroom_factor` a safety margin. FDO (`tilecore.compat.fdo`)
    refines these from measured batches.
    """
    return estimate(global_batch_size, global_device_count, num_sc_per_device, valency,
                    hot_shard_fraction, headroom_factor)
