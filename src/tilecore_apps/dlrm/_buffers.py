"""COO buffers for minibatched batches: room for the split, without the reference's 64×.

With `enable_minibatching` and no suggested size, a stack's COO buffer is the
reference's theoretical maximum, `roundup8(max_ids_per_partition)·S·N·64` per
device — 64 full minibatches, hundreds of thousands of entries for the click
model, filled and transferred every step. FDO's suggestion
(`update_preprocessing_parameters`) is what one unsplit batch needed, which a
split batch can exceed: each of its M minibatches starts every partition on a
multiple of 8 again.

A split batch holds the same entries as the unsplit one, at most the batch's
IDs. So a device needs at most its share of the stack's input IDs plus the
alignment of M·N partitions (≤ 7 each) on each of its S SparseCores, and ≤ 7
more per SparseCore segment. `minibatching_plan` sizes each buffer for
`max_minibatches` minibatches that way (or keeps FDO's suggestion if larger).
Batches split further may not fit; what does not fit is dropped and counted,
never silently lost.
"""

from __future__ import annotations

import dataclasses
import math

from tilecore.preprocessing import coo_buffer_size_per_device
from tilecore.stacking import StackingPlan, round_up

MAX_MINIBATCHES = 8
"""Minibatches a batch may be split into and still fit the buffer for sure."""


def minibatched_buffer_size(plan: StackingPlan, stack: str, *,
                            max_minibatches: int = MAX_MINIBATCHES) -> int:
    """COO entries per device that hold any batch of `stack` split into ≤ `max_minibatches`.

    Its inputs' IDs per device (global `input_shape` ÷ devices) plus the
    8-alignment of every (minibatch, partition) segment and SparseCore, rounded
    up to a multiple of 8·S as the buffers are.
    """
    if isinstance(max_minibatches, bool) or not 1 <= max_minibatches <= 64:
        raise ValueError(f"max_minibatches must be an integer in 1..64 (hash buckets), got "
                         f"{max_minibatches!r}.")
    topo = plan.topology
    n, s = topo.num_partitions, topo.sc_per_device
    ids = sum(math.prod(f.input_shape) for f in plan.stack_features(stack))
    per_device = -(-ids // topo.global_devices)
    return round_up(per_device + s * (7 * n * max_minibatches + 7), 8 * s)


def minibatching_plan(plan: StackingPlan, *, max_minibatches: int = MAX_MINIBATCHES
                      ) -> StackingPlan:
    """`plan` with `enable_minibatching` and COO buffers sized for split batches.

    Every stack's `suggested_coo_buffer_size_per_device` becomes the larger of
    its current suggestion (e.g. FDO's) and `minibatched_buffer_size`, capped by
    the reference's theoretical maximum with minibatching (64 full minibatches).
    The limits themselves are kept: batches over them are split instead of
    dropping IDs.
    """
    out = plan.with_config(enable_minibatching=True)
    for name, stack in plan.stacks.items():
        theoretical = coo_buffer_size_per_device(
            dataclasses.replace(stack, suggested_coo_buffer_size_per_device=None),
            plan.topology, enable_minibatching=True)
        need = max(stack.suggested_coo_buffer_size_per_device or 0,
                   minibatched_buffer_size(plan, name, max_minibatches=max_minibatches))
        out = out.with_stack_limits(
            name, suggested_coo_buffer_size_per_device=min(need, theoretical))
    return out
