"""Buffer sizes implied by limits, and limits implied by observed statistics."""

from __future__ import annotations

import numpy as np

from ..specs import Topology
from ..stacking import StackingPlan, StackSpec, round_up
from ._errors import LimitExceededError
from ._packed import ALIGNMENT, align_up, pointers_per_block
from ._types import PreprocessStats

MINIBATCHING_FACTOR = 64
"""Buffers with minibatching hold up to 64 minibatches (one per hash bucket)."""


def row_pointers_size_per_device(topology: Topology, *, enable_minibatching: bool = False
                                 ) -> int:
    """Row pointers per device: a block of max(N, 8) per SparseCore (and minibatch).

    With minibatching, room for 64 minibatches: `max(N, 8)·64·S`, as on the
    reference system (blocks past the batch's minibatches repeat the last end).
    """
    factor = MINIBATCHING_FACTOR if enable_minibatching else 1
    return pointers_per_block(topology.num_partitions) * factor * topology.sc_per_device


def coo_buffer_size_per_device(stack: StackSpec, topology: Topology, *,
                               enable_minibatching: bool = False) -> int:
    """COO entries per device: the suggested size rounded up to 8·S, else the maximum.

    The maximum, `roundup8(max_ids_per_partition)·S·N` (×64 with minibatching, as
    on the reference system), holds every partition of every SparseCore full to
    its limit (in every minibatch). The minibatching maximum is large (64 full
    minibatches are rare); set `suggested_coo_buffer_size_per_device` (e.g. from
    `update_preprocessing_parameters`) to size it to what batches need.
    """
    s, n = topology.sc_per_device, topology.num_partitions
    factor = MINIBATCHING_FACTOR if enable_minibatching else 1
    theoretical = align_up(stack.max_ids_per_partition) * s * n * factor
    suggested = stack.suggested_coo_buffer_size_per_device
    size = theoretical if suggested is None else round_up(suggested, ALIGNMENT * s)
    if size >= 2**31:
        raise ValueError(
            f"Stack {stack.name!r}: its COO buffer would hold {size} entries per device, past "
            f"the int32 offsets the row pointers use (2**31 - 1): roundup8("
            f"max_ids_per_partition={stack.max_ids_per_partition})·{s} SparseCores·{n} "
            f"partitions{f'·{factor} minibatches' if enable_minibatching else ''}"
            f"{'' if suggested is None else f', suggested {suggested}'}. Set "
            "suggested_coo_buffer_size_per_device to what batches need (e.g. with "
            "update_preprocessing_parameters from FDO statistics), or lower the limits.")
    if suggested is None:
        return theoretical
    if size > theoretical:
        raise ValueError(
            f"Stack {stack.name!r}: suggested_coo_buffer_size_per_device={suggested} exceeds the "
            f"largest buffer its limits can fill ({theoretical} = roundup8(max_ids_per_partition="
            f"{stack.max_ids_per_partition})·{s}·{n}"
            f"{f'·{factor}' if enable_minibatching else ''}). Lower the suggestion or leave "
            "it None."
        )
    return size


def check_limits(plan: StackingPlan, stats: PreprocessStats) -> None:
    """Raise `LimitExceededError` for the first stack whose statistics exceed its limits."""
    for name, stack in plan.stacks.items():
        for limit in ("max_ids_per_partition", "max_unique_ids_per_partition"):
            observed = np.asarray(getattr(stats, limit)[name])
            allowed = getattr(stack, limit)
            over = np.argwhere(observed > allowed)
            if over.size:
                device, partition = (int(x) for x in over[0])
                raise LimitExceededError(
                    stack=name, tables=stack.table_names, limit=limit, device=device,
                    partition=partition, observed=int(observed[device, partition]),
                    allowed=allowed, num_exceeding=len(over), worst=int(observed.max()),
                    stats=stats,
                )
