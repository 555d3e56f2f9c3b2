"""The host's half of device preprocessing: flat IDs in, checks of the device's counts out.

`tilecore.ops.preprocess_on_device` packs a batch on the device; the host only
validates the inputs' structure (as `preprocess` does, with the same errors),
copies each feature's IDs back to back into an int32 array of a fixed capacity
(`FlatFeature`), and afterwards checks the statistics the device returns against
the limits, with the same errors and warning as the host path. Numpy only: this
half runs wherever `preprocess` runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..stacking import StackingPlan
from ._inputs import Csr, checked_names
from ._layout import plan_layout
from ._preprocess import _check_ids_per_sample, _feature_csr

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class FlatFeature:
    """One feature's local rows as the device path takes them.

    Attributes:
      ids: int32 `[capacity]`: the rows' IDs back to back (row 0 first), then
        padding (zeros, never read). IDs outside int32 are clipped to -1 or
        2³¹−1, which every vocabulary rejects as the host path does.
      row_splits: int32 `[rows + 1]`: row r holds `ids[row_splits[r]:row_splits[r+1]]`.
      weights: float32 `[capacity]` aligned with `ids`, or None (unweighted, or
        all weights one, whose gains are the unweighted ones bit for bit).
    """

    ids: np.ndarray
    row_splits: np.ndarray
    weights: np.ndarray | None


def capacity(nominal: int, count: int) -> int:
    """IDs a feature's flat array holds: `nominal` (its local rows × the IDs per row
    its FeatureSpec declares), or the next power of two when a batch has more, so a
    handful of compiled programs serve every batch."""
    if count <= nominal:
        return max(nominal, 1)
    return 1 << (count - 1).bit_length()


def _flat(csr: Csr, size: int) -> FlatFeature:
    n = len(csr.values)
    ids = np.zeros(size, np.int32)
    if csr.values.dtype == np.int32:
        ids[:n] = csr.values
    else:
        np.clip(csr.values, -1, _INT32_MAX, out=ids[:n], casting="unsafe")
    weights = None
    if csr.weights is not None:
        weights = np.zeros(size, np.float32)
        weights[:n] = csr.weights
    return FlatFeature(ids, csr.splits.astype(np.int32), weights)


def flatten(plan: StackingPlan, inputs: Mapping[str, Any], weights: Mapping[str, Any] | None
            ) -> dict[str, FlatFeature]:
    """Every feature's inputs (any form `preprocess` takes) as `FlatFeature`s, after the
    structural checks of `preprocess` (names, shapes, dtypes, row counts, the IDs per
    sample), which raise its errors in its order. IDs and weights are checked on the
    device (`explain_input_error` names the first bad one)."""
    weights = checked_names(plan.features, inputs, weights)
    if plan.config.enable_minibatching:
        raise ValueError(
            "Device preprocessing does not minibatch (the plan has enable_minibatching=True): "
            "preprocess this plan on the host (tilecore.preprocess, preprocess_on='host'), or "
            "turn minibatching off (SparseCoreConfig(enable_minibatching=False)).")
    layout = plan_layout(plan)
    csrs: dict[str, Csr] = {}
    for name in plan.stacks:
        for feature in layout.stack_features[name]:
            csrs[feature.name] = _feature_csr(plan, layout, feature, inputs, weights, 1)
    _check_ids_per_sample(plan, csrs)
    flat = {}
    for name, csr in csrs.items():
        feature = plan.features[name]
        nominal = layout.local_rows[name] * int(np.prod(feature.input_shape[1:], dtype=np.int64))
        flat[name] = _flat(csr, capacity(nominal, len(csr.values)))
    return flat


def explain_input_error(plan: StackingPlan, inputs: Mapping[str, Any],
                        weights: Mapping[str, Any] | None) -> None:
    """Raise the error `preprocess` raises for these inputs (the device found an ID
    outside its vocabulary, a non-finite weight or a zero weight sum): the host's own
    checks name it, so the message and which error comes first are the host path's."""
    from ._preprocess import preprocess

    preprocess(plan, inputs, weights, num_threads=1)
    raise AssertionError("The device found an invalid ID or weight that preprocess accepts; "
                         "please report this as a bug in tilecore.")
