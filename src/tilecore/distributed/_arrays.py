"""Process-local host data ⇄ global `jax.Array`s split over one mesh axis.

With several processes each one preprocesses only the rows of its own devices:
process p's rows of every feature are the block of the global batch that its
devices hold along the mesh axis (`process_rows`). Within the process,
preprocessing splits that block evenly over its local devices and SparseCores
(REFERENCE §2, split-then-stack), so with the mesh's devices in process order the
samples land exactly where a single process would put them, and `lookup` /
`lookup_grad` give the same results.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..preprocessing import FeatureInput, PreprocessedBatch, Ragged
from ..specs import DEFAULT_AXIS
from ..specs._numbers import is_integer

T = TypeVar("T")


def _local_positions(mesh: Mesh, axis: str) -> range:
    """Positions along `axis` of this process's devices (a contiguous range)."""
    if axis not in mesh.axis_names:
        raise ValueError(f"The mesh has axes {mesh.axis_names}; no axis {axis!r}.")
    where = np.moveaxis(np.vectorize(lambda d: d.process_index == jax.process_index())(
        mesh.devices), mesh.axis_names.index(axis), 0)
    positions = np.flatnonzero(where.reshape(where.shape[0], -1).any(axis=1))
    if len(positions) == 0 or positions[-1] - positions[0] + 1 != len(positions):
        raise ValueError(
            f"Process {jax.process_index()} holds mesh positions {positions.tolist()} along "
            f"{axis!r}; they must be one contiguous block. Order the mesh's devices by process "
            "(jax.make_mesh does).")
    return range(int(positions[0]), int(positions[-1]) + 1)


def process_rows(global_rows: int, mesh: Mesh, axis: str = DEFAULT_AXIS) -> slice:
    """The rows of a `global_rows` batch this process preprocesses."""
    if not is_integer(global_rows) or global_rows < 0:
        raise ValueError(f"process_rows: global_rows must be an integer >= 0, got "
                         f"{global_rows!r}.")
    if axis not in mesh.shape:
        raise ValueError(f"process_rows: the mesh has axes {tuple(mesh.shape)}, not {axis!r}; "
                         "pass axis= the mesh axis the batch is split over.")
    size = mesh.shape[axis]
    if global_rows % size:
        raise ValueError(f"A global batch of {global_rows} rows does not split over the "
                         f"{size} devices of mesh axis {axis!r}; use a multiple of {size}.")
    positions, per = _local_positions(mesh, axis), global_rows // size
    return slice(positions.start * per, positions.stop * per)


def _slice_rows(name: str, value: Any, rows: slice, weights: Any) -> tuple[Any, Any]:
    if isinstance(value, Ragged):
        start, stop = int(value.row_splits[rows.start]), int(value.row_splits[rows.stop])
        cut = None if value.weights is None else value.weights[start:stop]
        splits = value.row_splits[rows.start:rows.stop + 1] - start
        flat = None if weights is None else np.asarray(weights)[start:stop]
        return Ragged(value.values[start:stop], splits, cut), flat
    if not hasattr(value, "shape") or len(value.shape) < 1:
        raise TypeError(f"Feature {name!r}: cannot split input of type {type(value).__name__} "
                        "by rows; pass a Ragged, a numpy array or a scipy.sparse matrix.")
    return value[rows], None if weights is None else weights[rows]


def local_inputs(
    inputs: Mapping[str, FeatureInput], weights: Mapping[str, Any] | None = None, *,
    mesh: Mesh, axis: str = DEFAULT_AXIS,
) -> tuple[dict[str, FeatureInput], dict[str, Any]]:
    """This process's rows of every feature's global inputs (and weights).

    For data pipelines that load the global batch everywhere; pipelines that load
    only their own rows must load `process_rows(batch, mesh, axis)`.
    """
    unknown = sorted(set(weights or {}) - set(inputs))
    if unknown:  # they would be left out in silence
        raise ValueError(f"local_inputs: weights given for features {unknown} that the inputs "
                         f"lack (features: {sorted(inputs)}).")
    out, out_weights = {}, {}
    for name, value in inputs.items():
        rows = value.num_rows if isinstance(value, Ragged) else getattr(value, "shape", (0,))[0]
        try:
            part = process_rows(rows, mesh, axis)
        except ValueError as error:
            raise ValueError(f"Feature {name!r}: {error}") from None
        out[name], w = _slice_rows(name, value, part, (weights or {}).get(name))
        if w is not None:
            out_weights[name] = w
    return out, out_weights


def to_global(tree: T, mesh: Mesh, axis: str = DEFAULT_AXIS) -> T:
    """Process-local arrays (leading dim = this process's share) → global arrays.

    Each leaf becomes a `jax.Array` whose leading dimension is split over `axis`
    (replicated over the mesh's other axes), this process's devices holding its
    rows in order. Scalars (such as a batch's `num_minibatches`, which agreement
    makes equal everywhere) become replicated arrays.
    """
    positions = _local_positions(mesh, axis)
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim == 0:
            return jax.make_array_from_process_local_data(replicated, x, x.shape)
        if x.shape[0] % len(positions):
            raise ValueError(
                f"to_global: a local array of shape {x.shape} does not split over this "
                f"process's {len(positions)} positions of mesh axis {axis!r}.")
        shape = (x.shape[0] // len(positions) * mesh.shape[axis], *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(place, tree)


def to_local(tree: T) -> T:
    """Global arrays split by their leading dimension → this process's rows (numpy)."""

    def local(x: jax.Array) -> np.ndarray:
        if not isinstance(x, jax.Array):
            raise TypeError(f"to_local: expected global jax.Arrays (what to_global returns), "
                            f"got a leaf of type {type(x).__name__}.")
        shards = {s.index[0].start or 0: s for s in x.addressable_shards}  # replicas collapse
        return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])

    return jax.tree.map(local, tree)


def global_batch(batch: PreprocessedBatch, mesh: Mesh, axis: str = DEFAULT_AXIS
                 ) -> PreprocessedBatch:
    """A process's preprocessed batch (`[local_devices, size]` buffers) as global arrays.

    The result (`[global_devices, size]` buffers split over `axis`) is what
    `tilecore.ops.lookup` and `lookup_grad` take on a mesh spanning all processes.
    """
    local = len(_local_positions(mesh, axis))
    for name, buffers in batch.stacks.items():
        shape = np.shape(buffers.row_pointers)
        if len(shape) != 2 or shape[0] != local:
            raise ValueError(
                f"global_batch: stack {name!r} has row_pointers of shape {shape}; expected "
                f"({local}, size), one row per local device of mesh axis {axis!r}. Preprocess "
                f"with has_leading_dimension=True and Topology(local_devices={local}).")
    return to_global(batch, mesh, axis)
