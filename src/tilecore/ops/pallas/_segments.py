"""The sorted-segment gather and combine as a Pallas kernel (Triton backend), and its two
uses: the lookup's pool and the update's gradient sums per row.

Both are `out[j] = Σ gain · values[index]` over the entries of segment `j`:

- `pool_rows` (`Wing.pool`): values = the table, index = the entry's row, segment =
  its sample. XLA sorts the entries by sample first.
- `row_gradients` (`Wing.row_gradients`): values = the activation gradients, index =
  the entry's sample, segment = its row's rank among the distinct rows. XLA sorts
  the entries by row first, which also lists the distinct rows.

The kernel (`combine_sorted`) takes the sorted entries and CSR offsets (segment
`j`'s entries at `[offsets[j], offsets[j + 1])`). Program `i` of a 1-D grid owns
`B` consecutive segments (output rows) and walks their entries in step, the `t`-th
entry of every segment at once, for `max(count)` steps. Each step gathers `B`
rows of values (`[B, D]` lanes, `D` the width rounded up to a power of two, the
lanes past the width masked), widens them to float32 (half-precision tables are
read as stored) and adds `gain · row` to a float32 accumulator; the block is
written once, coalesced. No atomics and no `[entries, dim]` intermediate in
memory (XLA's gather and `segment_sum` write every gathered row out and
scatter-add it back); each segment sums in buffer order, so a result is the same
on every run. An index outside `values` contributes nothing, as in the CPU wing.

The block size and warp count are first guesses, not tuned (the wing's training step
measured 6x slower than XLA's on an H200 at batch 4096, 23x at 65536: see
`tilecore.ops.pallas`), and a block waits for its longest segment: a hot row with many
entries keeps its block's other lanes idle in `row_gradients`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._backend import RowGradients
from ..xla._wing import sort_by, sorted_segments

_LANES_PER_PROGRAM = 2048
"""Target `B · D` accumulator lanes of one program (a guess, not tuned)."""
_MAX_SEGMENTS_PER_PROGRAM = 16
"""Upper bound on `B`: a block waits for its longest segment, so small blocks waste
fewer steps on skewed segment lengths."""


def pool_rows(table: jax.Array, rows: jax.Array, segments: jax.Array, gains: jax.Array,
              num_segments: int, quantization: Any, *, interpret: bool) -> jax.Array:
    """`[num_segments, dim]` float32: `Σ gain · table[row]` per segment, entries whose
    segment is out of range dropped (`Wing.pool`; `interpret` runs the kernel in
    Pallas's interpreter, on any backend)."""
    assert quantization is None  # `_backend.lookup_wing` sends quantized tables to XLA
    keys = jnp.where((segments >= 0) & (segments < num_segments), segments, num_segments)
    keys, rows, gains = sort_by(keys.astype(jnp.int32), rows.astype(jnp.int32),
                                gains.astype(jnp.float32))
    return combine_sorted(_offsets(keys, num_segments), rows, gains, table, num_segments,
                          interpret=interpret)


def row_gradients(rows: jax.Array, valid: jax.Array, samples: jax.Array, gains: jax.Array,
                  grads: jax.Array, sentinel: int, *, interpret: bool) -> RowGradients:
    """`Σ gain · grads[sample]` per distinct row of the valid entries (`Wing.row_gradients`):
    the distinct rows ascending, padded with `sentinel`, their sums, and None (the
    invalid entries' sums land on the sentinel, a row outside the shard)."""
    samples, gains, segment, unique = sorted_segments(rows, valid, samples, gains, sentinel)
    size = unique.shape[0]
    sums = combine_sorted(_offsets(segment, size), samples, gains, grads, size,
                          interpret=interpret)
    return unique, sums, None


def _offsets(keys: jax.Array, num_segments: int) -> jax.Array:
    """`int32[num_segments + 1]`: where each segment's entries start in `keys` (sorted, in
    `[0, num_segments]`), and where the entries past the last segment start."""
    counts = jnp.zeros((num_segments + 1,), jnp.int32).at[keys].add(1)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)[:-1]])


def combine_sorted(offsets: jax.Array, indices: jax.Array, gains: jax.Array,
                   values: jax.Array, num_segments: int, *, interpret: bool) -> jax.Array:
    """`[num_segments, dim]` float32: `Σ gain · values[index]` over each segment's entries
    `[offsets[j], offsets[j + 1])` of the sorted `indices` and `gains`."""
    dim = values.shape[1]
    if num_segments == 0 or dim == 0 or indices.shape[0] == 0:
        return jnp.zeros((num_segments, dim), jnp.float32)
    lanes = pl.next_power_of_2(dim)
    block = max(1, min(_MAX_SEGMENTS_PER_PROGRAM, _LANES_PER_PROGRAM // lanes))
    programs = -(-num_segments // block)
    combined = pl.pallas_call(
        functools.partial(_kernel, dim=dim, num_segments=num_segments),
        out_shape=jax.ShapeDtypeStruct((programs * block, lanes), jnp.float32),
        grid=(programs,),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.BlockSpec((block, lanes), lambda i: (i, 0)),
        compiler_params=plgpu.CompilerParams(
            num_warps=max(1, min(4, block * lanes // 256)), num_stages=1),
        interpret=interpret,
        name="tilecore_combine_sorted",
    )(offsets, indices, gains, values)
    return combined[:num_segments, :dim]


def _kernel(offsets_ref: Any, indices_ref: Any, gains_ref: Any, values_ref: Any,
            out_ref: Any, *, dim: int, num_segments: int) -> None:
    """One program: its `B` segments' combined rows into its `[B, D]` output block."""
    block, lanes = out_ref.shape
    num_values = values_ref.shape[0]
    segment = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    inside = segment < num_segments
    segment = jnp.minimum(segment, num_segments - 1)
    starts = offsets_ref[segment]
    counts = jnp.where(inside, offsets_ref[segment + 1] - starts, 0)
    column = jnp.arange(lanes, dtype=jnp.int32)
    in_row = column < dim
    column = jnp.minimum(column, dim - 1)  # masked lanes read an address inside the row

    def step(t: jax.Array, total: jax.Array) -> jax.Array:
        live = t < counts
        entry = jnp.where(live, starts + t, 0)
        index = indices_ref[entry]
        live = live & (index >= 0) & (index < num_values)  # never a read outside
        row = plgpu.load(values_ref.at[jnp.where(live, index, 0)[:, None], column[None, :]],
                         mask=live[:, None] & in_row[None, :], other=0)
        gain = jnp.where(live, gains_ref[entry], 0.0)
        return total + gain[:, None] * row.astype(jnp.float32)

    total = jax.lax.fori_loop(0, jnp.max(counts), step, jnp.zeros((block, lanes), jnp.float32))
    out_ref[...] = total
