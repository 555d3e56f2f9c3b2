"""The sorted-segment gather and combine as a Pallas kernel (Triton backend).

`pool_rows` computes what `Wing.pool` promises, `Σ gain · table[row]` per segment, in
two steps:

1. XLA sorts the entries by segment (one stable sort of the keys carrying rows and
   gains; entries of segments out of range get the key `num_segments`, past every
   real one) and turns the per-segment counts into CSR offsets.
2. The kernel: program `i` of a 1-D grid owns `B` consecutive segments (output
   rows) and walks their entries in step, the `t`-th entry of every segment at
   once, for `max(count)` steps. Each step gathers `B` table rows (`[B, D]` lanes,
   `D` the width rounded up to a power of two, lanes past the width masked),
   widens them to float32 and adds `gain · row` to a float32 accumulator; the
   block is written once, coalesced.

No atomics and no `[entries, dim]` intermediate in memory (XLA's gather and
`segment_sum` write every gathered row out and scatter-add it back); the sum
of each segment runs in buffer order, so a result is the same on every run.
Half-precision tables (bfloat16, float16) are read as stored and widened in
registers.

The block size and warp count are first guesses, not measurements (see
`tilecore.ops.pallas`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_LANES_PER_PROGRAM = 2048
"""Target `B · D` accumulator lanes of one program (a guess: unmeasured)."""
_MAX_SEGMENTS_PER_PROGRAM = 16
"""Upper bound on `B`: a block waits for its longest segment, so small blocks waste
fewer steps on skewed segment lengths."""


def pool_rows(table: jax.Array, rows: jax.Array, segments: jax.Array, gains: jax.Array,
              num_segments: int, quantization: Any, *, interpret: bool) -> jax.Array:
    """`[num_segments, dim]` float32: `Σ gain · table[row]` per segment, entries whose
    segment is out of range dropped (`Wing.pool`; `interpret` runs the kernel in
    Pallas's interpreter, on any backend)."""
    assert quantization is None  # `_backend.lookup_wing` sends quantized tables to XLA
    dim = table.shape[1]
    if num_segments == 0 or dim == 0 or rows.shape[0] == 0:
        return jnp.zeros((num_segments, dim), jnp.float32)
    offsets, rows, gains = _sorted_by_segment(rows, segments, gains, num_segments)
    lanes = pl.next_power_of_2(dim)
    block = max(1, min(_MAX_SEGMENTS_PER_PROGRAM, _LANES_PER_PROGRAM // lanes))
    programs = -(-num_segments // block)
    kernel = functools.partial(_pool_kernel, dim=dim, num_segments=num_segments)
    pooled = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((programs * block, lanes), jnp.float32),
        grid=(programs,),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.BlockSpec((block, lanes), lambda i: (i, 0)),
        compiler_params=plgpu.CompilerParams(
            num_warps=max(1, min(4, block * lanes // 256)), num_stages=1),
        interpret=interpret,
        name="tilecore_pool_rows",
    )(offsets, rows, gains, table)
    return pooled[:num_segments, :dim]


def _sorted_by_segment(rows: jax.Array, segments: jax.Array, gains: jax.Array,
                       num_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(offsets [num_segments + 1], rows, gains)`: the entries sorted by segment, segment
    `j`'s at `[offsets[j], offsets[j + 1])`; entries of segments out of range lie past
    `offsets[num_segments]`, never read."""
    keys = jnp.where((segments >= 0) & (segments < num_segments), segments, num_segments)
    keys, rows, gains = jax.lax.sort(
        (keys.astype(jnp.int32), rows.astype(jnp.int32), gains.astype(jnp.float32)),
        num_keys=1, is_stable=True)
    counts = jnp.zeros((num_segments + 1,), jnp.int32).at[keys].add(1)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)[:-1]])
    return offsets, rows, gains


def _pool_kernel(offsets_ref: Any, rows_ref: Any, gains_ref: Any, table_ref: Any,
                 out_ref: Any, *, dim: int, num_segments: int) -> None:
    """One program: its `B` segments' pooled rows into its `[B, D]` output block."""
    block, lanes = out_ref.shape
    num_rows = table_ref.shape[0]
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
        row = rows_ref[entry]
        live = live & (row >= 0) & (row < num_rows)  # as the CPU wing: no read outside
        values = plgpu.load(table_ref.at[jnp.where(live, row, 0)[:, None], column[None, :]],
                            mask=live[:, None] & in_row[None, :], other=0)
        gain = jnp.where(live, gains_ref[entry], 0.0)
        return total + gain[:, None] * values.astype(jnp.float32)

    total = jax.lax.fori_loop(0, jnp.max(counts), step, jnp.zeros((block, lanes), jnp.float32))
    out_ref[...] = total
