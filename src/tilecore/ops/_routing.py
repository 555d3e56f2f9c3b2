"""Which partition each COO entry addresses, and moving entries to their owner device.

Entries live in per-SparseCore slots; row pointers give each partition's
exclusive end, partitions start on multiples of 8, and positions outside the
pointed ranges are filler. Entries for device t's partitions form one
contiguous window of each slot, so a fixed-size window per (SparseCore, device)
carries them through one all-to-all.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..preprocessing._packed import align_up
from ._layout import StackLayout


class Entries(NamedTuple):
    """COO entries with the partition each addresses (`valid` marks real entries)."""

    embedding_ids: jax.Array
    sample_ids: jax.Array
    gains: jax.Array
    partitions: jax.Array
    valid: jax.Array


def slot_entries(row_pointers: jax.Array, embedding_ids: jax.Array, sample_ids: jax.Array,
                 gains: jax.Array, layout: StackLayout) -> Entries:
    """One device's buffers as `[S, slot]` entries tagged with partition and validity."""
    s, n = layout.sc_per_device, layout.num_partitions
    ends = row_pointers.reshape(s, layout.pointers_per_sc)[:, :n]
    starts = jnp.concatenate([jnp.zeros((s, 1), ends.dtype), align_up(ends[:, :-1])], 1)
    position = jnp.arange(layout.slot, dtype=ends.dtype)
    partition = jax.vmap(lambda e: jnp.searchsorted(e, position, side="right"))(ends)
    clipped = jnp.minimum(partition, n - 1)
    valid = (partition < n) & (position[None, :] >= jnp.take_along_axis(starts, clipped, 1))
    shape = (s, layout.slot)
    return Entries(
        embedding_ids.reshape(shape), sample_ids.reshape(shape),
        jnp.where(valid, gains.reshape(shape), 0.0), clipped.astype(jnp.int32), valid,
    )


def windows_by_device(entries: Entries, row_pointers: jax.Array, layout: StackLayout) -> Entries:
    """`[G, S, capacity]` entries: for each destination device, each SparseCore's window."""
    s, g, k = layout.sc_per_device, layout.num_devices, layout.capacity
    ends = row_pointers.reshape(s, layout.pointers_per_sc)[:, : layout.num_partitions]
    starts = jnp.concatenate([jnp.zeros((s, 1), ends.dtype), align_up(ends[:, :-1])], 1)
    first = jnp.minimum(starts[:, ::s], layout.slot - k)  # [S, G]
    index = first[:, :, None] + jnp.arange(k, dtype=first.dtype)  # [S, G, K]
    flat = index.reshape(s, g * k)

    def take(x: jax.Array) -> jax.Array:
        return jnp.take_along_axis(x, flat, 1).reshape(s, g, k).transpose(1, 0, 2)

    picked = Entries(*(take(x) for x in entries))
    owner = jnp.arange(g, dtype=jnp.int32)[:, None, None]
    mine = picked.valid & (picked.partitions // s == owner)
    return picked._replace(valid=mine, gains=jnp.where(mine, picked.gains, 0.0))


def exchange(entries: Entries, axis: str) -> Entries:
    """All-to-all over `axis`: entry windows `[G(dest), ...]` become `[G(source), ...]`.

    The five fields travel as one int32 array (gains bit-cast, validity widened), so a
    stack's entries cross the mesh in one collective, not five: one message per peer on
    a GPU interconnect, and one all-to-all for XLA to compile (on CPU it expands each
    into G copies, which made compile time grow with the device count).
    """
    packed = jnp.stack([_as_int32(x) for x in entries], axis=-1)
    received = jax.lax.all_to_all(packed, axis, 0, 0, tiled=True)
    return Entries(*(_from_int32(received[..., k], x.dtype) for k, x in enumerate(entries)))


def _as_int32(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32)
    if x.dtype.itemsize != 4:
        raise TypeError(f"an entry field of dtype {x.dtype} cannot travel as int32")
    return x if x.dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, jnp.int32)


def _from_int32(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    if dtype == jnp.bool_:
        return x != 0
    return x if dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, dtype)
