"""The Pallas wing: the XLA wing with the lookup's gather and combine as a Pallas kernel."""

from __future__ import annotations

import dataclasses
import functools

import jax

from .._backend import FlatBuffers, Wing
from .._layout import StackLayout
from ..xla import WING as XLA
from ..xla._wing import pooled_locally
from ._pool import pool_rows


@functools.cache
def pallas_wing(interpret: bool) -> Wing:
    """The XLA wing whose `pool` is the Pallas kernel (`_pool`), compiled by Triton, or run
    in Pallas's interpreter on any backend when `interpret` (slow: for tests)."""

    def lookup_local(flat: FlatBuffers, table: jax.Array, layout: StackLayout,
                     num_minibatches: jax.Array) -> jax.Array:
        return pooled_locally(kernels, flat, table, layout, num_minibatches)

    kernels = dataclasses.replace(
        XLA, name="pallas", pool=functools.partial(pool_rows, interpret=interpret),
        lookup_local=lookup_local)
    return kernels
