"""The Pallas wing: the XLA wing with its sorted-segment reductions as a Pallas kernel."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax

from .._activations import ActivationSlice, take_slices
from .._backend import FlatBuffers, Wing
from .._layout import StackLayout
from .._variables import EmbeddingVariables
from ..xla import WING as XLA
from ..xla._wing import pooled_locally, updated_locally
from ._segments import pool_rows, row_gradients


@functools.cache
def pallas_wing(interpret: bool) -> Wing:
    """The XLA wing whose `pool` and `row_gradients` are the Pallas kernel (`_segments`),
    compiled by Triton, or run in Pallas's interpreter on any backend when `interpret`
    (slow: for tests). The optimizer is applied by XLA."""

    def lookup_local(flat: FlatBuffers, table: jax.Array, layout: StackLayout,
                     num_minibatches: jax.Array, slices: Sequence[ActivationSlice]
                     ) -> list[jax.Array]:
        return take_slices(pooled_locally(kernels, flat, table, layout, num_minibatches),
                           layout, slices)

    def update_local(*args: Any) -> EmbeddingVariables:
        return updated_locally(kernels, *args)

    kernels = dataclasses.replace(
        XLA, name="pallas", pool=functools.partial(pool_rows, interpret=interpret),
        row_gradients=functools.partial(row_gradients, interpret=interpret),
        lookup_local=lookup_local, update_local=update_local)
    return kernels
