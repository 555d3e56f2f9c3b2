"""What a batch was preprocessed for, so that the device ops can refuse another plan's.

A batch's buffers are only meaningful under the plan that packed them: its topology,
layout (plain or minibatched), each stack's rows, width, samples and limits, and
each feature's place in its stack. Two plans that agree on all of these read the
same buffers alike; any difference (another batch size, vocabulary, limit, device
count) makes the ops read garbage or, in compiled kernels, out of bounds. The
signature is a tuple of `(item, value)` pairs, so a mismatch can be named.
"""

from __future__ import annotations

from ..stacking import StackingPlan
from ._limits import coo_buffer_size_per_device

Signature = tuple[tuple[str, str], ...]


def batch_signature(plan: StackingPlan) -> Signature:
    """The items of `plan` that decide how its batches' buffers are laid out and read."""
    topology, minibatching = plan.topology, plan.config.enable_minibatching
    items = [("topology", f"{topology.global_devices} device(s) x "
                          f"{topology.sc_per_device} SparseCore(s)"),
             ("layout", "minibatched" if minibatching else "plain")]
    for name in sorted(plan.stacks):
        stack = plan.stacks[name]
        size = coo_buffer_size_per_device(stack, topology, enable_minibatching=minibatching)
        items.append((f"stack {name!r}", (
            f"{stack.vocab_size} rows x {stack.embedding_dim}, {stack.total_sample_count} "
            f"samples, max_ids_per_partition {stack.max_ids_per_partition}, "
            f"{size} COO entries per device")))
    for name in sorted(plan.feature_settings):
        setting = plan.feature_settings[name]
        items.append((f"feature {name!r}", (
            f"stack {setting.stack_name!r}, row_offset {setting.row_offset}, col_offset "
            f"{setting.col_offset}, col_shift {setting.col_shift}")))
    return tuple(items)


def signature_differences(made_for: Signature, plan: StackingPlan) -> list[str]:
    """`item: batch's value vs plan's value` for each item where they differ."""
    want = dict(batch_signature(plan))
    got = dict(made_for)
    return [f"{item}: {got.get(item, 'absent')} (batch) vs {want.get(item, 'absent')} (plan)"
            for item in sorted(got.keys() | want.keys()) if got.get(item) != want.get(item)]
