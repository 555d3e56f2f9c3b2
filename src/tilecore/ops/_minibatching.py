"""The minibatched buffer layout: finding one minibatch's entries.

With `enable_minibatching` a device's row pointers are `64·S` blocks of
`P = max(N, 8)`; block `k = sc·M + mb` (M minibatches) describes SparseCore sc's
segment of minibatch mb. Pointers are *absolute* exclusive ends of each
partition in the device's COO buffer; partition p starts at `roundup8` of the
end before it, where the end before partition 0 of block k is the last end of
block k−1 (0 for k = 0). Segments are therefore packed back to back,
SparseCore-major then by minibatch, each partition 8-aligned; unused pointer
slots and blocks repeat the last end, and positions outside the pointed ranges
are filler.

Each minibatch's partitions fit the stack's `max_ids_per_partition`, so one
device's entries of a minibatch for one partition span at most
`roundup8(max_ids_per_partition)` positions: the ops read fixed-size windows
(static shapes) at traced offsets, exactly as the single-pass path reads its
per-SparseCore slots, and mask everything outside the pointed ranges.

Preprocessing puts every occurrence of a row into one minibatch (its hash bucket),
so on one device the update can also read the whole buffer at once
(`buffer_entries`): the minibatches touch disjoint rows, and one optimizer pass
over all of them equals one pass per minibatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..preprocessing._packed import ALIGNMENT, align_up
from ._layout import StackLayout
from ._routing import Entries

MAX_MINIBATCHES = 64
"""Hash buckets, hence the most minibatches a batch can be split into."""


def check_sizes(row_pointers: jax.Array, embedding_ids: jax.Array, layout: StackLayout) -> None:
    """Raise if one device's flat buffers do not have the minibatched layout's sizes."""
    expected = layout.pointers_per_sc * MAX_MINIBATCHES * layout.sc_per_device
    if row_pointers.shape[0] != expected:
        raise ValueError(
            f"Stack {layout.name!r}: the plan enables minibatching, so each device's "
            f"row_pointers must hold max(N, 8)·64·S = {layout.pointers_per_sc}·64·"
            f"{layout.sc_per_device} = {expected} entries; got {row_pointers.shape[0]}. "
            "Preprocess with the same plan (plan.config.enable_minibatching) the ops get."
        )
    if embedding_ids.shape[0] < ALIGNMENT:
        raise ValueError(
            f"Stack {layout.name!r}: a device's COO buffer holds {embedding_ids.shape[0]} "
            "entries; the minibatched layout needs at least 8."
        )


def block_bounds(row_pointers: jax.Array, layout: StackLayout, minibatch: jax.Array,
                 num_minibatches: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Absolute `(starts, ends)` `[S, N]` of every partition of one minibatch, per SparseCore."""
    p, n, s = layout.pointers_per_sc, layout.num_partitions, layout.sc_per_device
    blocks = jnp.arange(s, dtype=jnp.int32) * num_minibatches + minibatch  # [S]
    ends = row_pointers[blocks[:, None] * p + jnp.arange(n, dtype=jnp.int32)]
    before = jnp.where(blocks > 0, row_pointers[jnp.maximum(blocks * p - p + n - 1, 0)], 0)
    previous = jnp.concatenate([before[:, None], ends[:, :-1]], axis=1)
    return align_up(previous), ends


def minibatch_windows(row_pointers: jax.Array, embedding_ids: jax.Array, sample_ids: jax.Array,
                      gains: jax.Array, layout: StackLayout, minibatch: jax.Array,
                      num_minibatches: jax.Array) -> Entries:
    """One minibatch's entries as `[G(dest), S, K]` windows, one per (destination, SparseCore).

    The window of SparseCore s for device t starts at partition `t·S` of s's block
    and spans `K = min(S·roundup8(max_ids_per_partition), buffer)` positions, which
    cover partitions `t·S … t·S+S−1` (shifted back if it would run past the buffer);
    entries of other partitions, blocks or filler are marked invalid.
    """
    s, g, n = layout.sc_per_device, layout.num_devices, layout.num_partitions
    size = embedding_ids.shape[0]
    k = min(s * layout.partition_span, size)
    starts, ends = block_bounds(row_pointers, layout, minibatch, num_minibatches)
    first = jnp.minimum(starts[:, ::s], size - k)  # [S, G]
    position = first[:, :, None] + jnp.arange(k, dtype=first.dtype)  # [S, G, K]
    flat = position.reshape(s, g * k)
    partition = jax.vmap(lambda e, x: jnp.searchsorted(e, x, side="right"))(ends, flat)
    clipped = jnp.minimum(partition, n - 1)
    valid = (partition < n) & (flat >= jnp.take_along_axis(starts, clipped, 1))
    owner = jnp.arange(g, dtype=jnp.int32)[None, :, None]
    valid = valid.reshape(s, g, k) & (clipped.reshape(s, g, k) // s == owner)

    def take(x: jax.Array) -> jax.Array:
        return x[position].transpose(1, 0, 2)

    valid = valid.transpose(1, 0, 2)
    return Entries(take(embedding_ids), take(sample_ids),
                   jnp.where(valid, take(gains), 0.0),
                   clipped.reshape(s, g, k).transpose(1, 0, 2).astype(jnp.int32), valid)


def buffer_entries(row_pointers: jax.Array, embedding_ids: jax.Array, sample_ids: jax.Array,
                   gains: jax.Array, layout: StackLayout, num_minibatches: jax.Array
                   ) -> tuple[Entries, jax.Array]:
    """Every minibatch's entries of one device's buffer at once, and each one's SparseCore.

    Returns flat `[size]` entries (one per buffer position; filler marked invalid) and
    the `int32[size]` SparseCore whose samples each entry belongs to.

    Pointer j's range is `[roundup8(end[j-1]), end[j])`. The starts are nondecreasing
    and 8-aligned, and a range never shares its start with a later non-empty one, so
    position x lies in range `j = #{starts <= x} - 1` if `x < end[j]`, and all 8
    positions of an aligned group share `j`: one cumulative count over `size / 8`
    groups finds every range (no search and no loop over the minibatches).
    """
    p, n, s = layout.pointers_per_sc, layout.num_partitions, layout.sc_per_device
    size = embedding_ids.shape[0]
    groups = -(-size // ALIGNMENT)
    previous = jnp.concatenate([jnp.zeros((1,), row_pointers.dtype), row_pointers[:-1]])
    first_group = jnp.clip(align_up(previous) // ALIGNMENT, 0, groups)  # starts / 8
    hits = jnp.zeros((groups + 1,), jnp.int32).at[first_group].add(1)
    pointer = jnp.cumsum(hits)[:groups] - 1  # [groups]: the range each group lies in
    end = row_pointers[pointer]
    block, partition = pointer // p, pointer % p
    source = block // num_minibatches
    real = (partition < n) & (source < s)
    position = jnp.arange(groups * ALIGNMENT, dtype=end.dtype).reshape(groups, ALIGNMENT)
    valid = (real[:, None] & (position < end[:, None])).reshape(-1)[:size]

    def per_entry(x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(x[:, None], (groups, ALIGNMENT)).reshape(-1)[:size]

    entries = Entries(embedding_ids, sample_ids, jnp.where(valid, gains, 0.0),
                      per_entry(jnp.minimum(partition, n - 1).astype(jnp.int32)), valid)
    return entries, per_entry(jnp.where(real, source, 0).astype(jnp.int32))
