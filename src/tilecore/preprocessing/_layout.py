"""What preprocessing derives from a plan alone, computed once per plan.

Every batch of a plan has the same local rows per feature, ID-transform and radix
sort parameters and buffer sizes per stack; recomputing them was most of the
fixed cost of preprocessing a small batch. Plans are immutable values but hold
dicts, so they do not hash: layouts are cached by the plan's identity, checked
through a weak reference (an id can be reused once its plan is gone), and an
entry is dropped with its plan.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref

import numpy as np

from ..specs import FeatureSpec
from ..stacking import StackingPlan, StackSpec
from . import _kernels as k
from ._limits import coo_buffer_size_per_device, row_pointers_size_per_device
from ._signature import Signature, batch_signature

_COMBINER_CODES = {"sum": k.SUM, "mean": k.MEAN, "sqrtn": k.SQRTN}
_RADIX_BITS = 12

BufferSpec = tuple[tuple[int, int], type[np.generic]]


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
    """Where one feature's samples and IDs go in its stack."""

    feature: FeatureSpec
    rows_per_sc: int
    sample_base: int
    shift: int
    col_offset: int


@dataclasses.dataclass(frozen=True)
class StackPreprocessing:
    """One stack's features in sample order, sort parameters and buffer shapes."""

    stack: StackSpec
    features: tuple[FeatureLayout, ...]
    combiner: int
    log2n: int
    rowbits: int
    digit_bits: int
    passes: int
    samples_per_sc: int
    slot: int
    """COO entries per SparseCore (its share of the device buffer)."""
    buffers: tuple[BufferSpec, BufferSpec, BufferSpec, BufferSpec]
    """(shape, dtype) of row_pointers, embedding_ids, sample_ids and gains."""


class PlanLayout:
    """What every batch of one plan shares.

    Attributes:
      local_rows: feature name → this process's rows of that feature.
      max_ids: an upper bound on the IDs of one batch (it sets the default threads).
      stack_features: stack name → its features in sample order.

    A stack's `StackPreprocessing` is built when first asked for (after the stack's
    inputs were converted), so a stack the plan cannot preprocess raises at the
    same point of every call: after any error in the inputs before it.
    """

    def __init__(self, plan: StackingPlan) -> None:
        self.local_rows = {name: _local_rows(f, plan) for name, f in plan.features.items()}
        self.max_ids = sum(self.local_rows[name] * math.prod(f.input_shape[1:])
                           for name, f in plan.features.items())
        self.stack_features = {name: plan.stack_features(name) for name in plan.stacks}
        self._stacks: dict[str, StackPreprocessing] = {}
        self._signature: Signature | None = None

    def stack(self, plan: StackingPlan, name: str) -> StackPreprocessing:
        """The layout of stack `name` of `plan` (the plan this layout was built from)."""
        layout = self._stacks.get(name)
        if layout is None:
            layout = self._stacks[name] = _stack_layout(plan, plan.stacks[name], self.local_rows)
        return layout

    def signature(self, plan: StackingPlan) -> Signature:
        """`batch_signature(plan)` (of the plan this layout was built from), computed once."""
        if self._signature is None:
            self._signature = batch_signature(plan)
        return self._signature


_lock = threading.Lock()
_layouts: dict[int, tuple[weakref.ref[StackingPlan], PlanLayout]] = {}


def plan_layout(plan: StackingPlan) -> PlanLayout:
    """The plan's layout, built on first use (raising the plan's batch-size errors)."""
    key = id(plan)
    entry = _layouts.get(key)
    if entry is not None and entry[0]() is plan:
        return entry[1]
    layout = PlanLayout(plan)

    def forget(ref: weakref.ref[StackingPlan]) -> None:
        with _lock:
            if key in _layouts and _layouts[key][0] is ref:
                del _layouts[key]

    with _lock:
        _layouts[key] = (weakref.ref(plan, forget), layout)
    return layout


def _local_rows(feature: FeatureSpec, plan: StackingPlan) -> int:
    topo = plan.topology
    rows, rem = divmod(feature.batch_size * topo.num_local_devices, topo.global_devices)
    per_sc, rem_sc = divmod(rows, topo.num_local_devices * topo.sc_per_device)
    if rem or rem_sc or per_sc == 0:
        raise ValueError(
            f"Feature {feature.name!r}: its global batch of {feature.batch_size} rows does not "
            f"split evenly over {topo.global_devices} devices × {topo.sc_per_device} SparseCores "
            f"(topology {topo}). Use a batch size that is a multiple of "
            f"{topo.global_devices * topo.sc_per_device}."
        )
    return rows


def _stack_layout(plan: StackingPlan, stack: StackSpec, local_rows: dict[str, int]
                  ) -> StackPreprocessing:
    topo = plan.topology
    n, s, local = topo.num_partitions, topo.sc_per_device, topo.num_local_devices
    features = []
    for feature in plan.stack_features(stack.name):
        setting = plan.feature_settings[feature.name]
        features.append(FeatureLayout(
            feature=feature, rows_per_sc=local_rows[feature.name] // (local * s),
            sample_base=setting.row_offset // n, shift=setting.col_shift,
            col_offset=setting.col_offset,
        ))
    samples_per_sc = sum(f.rows_per_sc for f in features)
    if samples_per_sc >= 1 << k.SAMPLE_BITS:
        raise ValueError(
            f"Stack {stack.name!r}: {samples_per_sc} samples per SparseCore; at most "
            f"{(1 << k.SAMPLE_BITS) - 1} are supported. Use more devices or a smaller batch."
        )
    log2n = n.bit_length() - 1
    rowbits = max(1, (stack.vocab_size // n - 1).bit_length())
    total_bits = log2n + rowbits
    passes = -(-total_bits // _RADIX_BITS)
    minibatching = plan.config.enable_minibatching
    coo = coo_buffer_size_per_device(stack, topo, enable_minibatching=minibatching)
    rows = row_pointers_size_per_device(topo, enable_minibatching=minibatching)
    return StackPreprocessing(
        stack=stack, features=tuple(features), combiner=_COMBINER_CODES[stack.combiner],
        log2n=log2n, rowbits=rowbits, digit_bits=-(-total_bits // passes), passes=passes,
        samples_per_sc=samples_per_sc, slot=coo // s,
        buffers=(((local, rows), np.int32), ((local, coo), np.int32), ((local, coo), np.int32),
                 ((local, coo), np.float32)),
    )
