"""The errors of inputs that host preprocessing's kernels find while staging a batch."""

from __future__ import annotations

import numpy as np

from ..specs import FeatureSpec
from . import _kernels as k
from ._inputs import Csr


def raise_input_error(code: int, feature: FeatureSpec, csr: Csr, where: int) -> None:
    """Raise the error of a staging kernel's `code` (`_kernels`: a weight that is not
    finite, an ID outside the table, a row whose weights cannot be combined) at `where`
    (a row or a position of `feature`'s CSR), naming the feature, table, row and value."""
    table = feature.table
    if code == k.ZERO_WEIGHT_SUM:
        _raise_underflow(feature, csr, where)
        raise ValueError(
            f"Feature {feature.name!r}: the weights of row {where} sum to zero, so the "
            f"{table.combiner!r} combiner of table {table.name!r} cannot normalise them. "
            "Give the row non-zero weights, drop it, or use the 'sum' combiner."
        )
    if code == k.INFINITE_WEIGHT_SUM:
        assert csr.weights is not None
        row_weights = csr.weights[csr.splits[where]:csr.splits[where + 1]]
        if table.combiner == "sum":
            raise ValueError(
                f"Feature {feature.name!r}: the weights of an ID repeated in row {where} "
                f"(largest magnitude {np.max(np.abs(row_weights)):g}) overflow float32 when "
                f"the 'sum' combiner of table {table.name!r} merges its duplicates (its gain "
                "would be inf). Scale the row's weights down."
            )
        summed = "sums their squares" if table.combiner == "sqrtn" else "sums them"
        raise ValueError(
            f"Feature {feature.name!r}: the weights of row {where} (largest magnitude "
            f"{np.max(np.abs(row_weights)):g}) overflow float32 when the {table.combiner!r} "
            f"combiner of table {table.name!r} {summed}, so it cannot normalise them (every "
            "gain would be 0). Scale the row's weights down."
        )
    row = int(np.searchsorted(csr.splits, where, side="right") - 1)
    if code == k.BAD_WEIGHT:
        assert csr.weights is not None
        raise ValueError(
            f"Feature {feature.name!r}: weight {csr.weights[where]} at row {row} (position "
            f"{where}) is not finite; weights must be finite numbers."
        )
    raise ValueError(
        f"Feature {feature.name!r}: ID {csr.values[where]} at row {row} (position {where}) is "
        f"outside [0, {table.vocab_size}), the vocabulary of table {table.name!r}."
    )


SQUARE_UNDERFLOW = (float(np.finfo(np.float32).smallest_subnormal) / 2) ** 0.5
"""Weights of smaller magnitude square to 0 in float32 (about 2.6e-23)."""


def _raise_underflow(feature: FeatureSpec, csr: Csr, row: int) -> None:
    """For 'sqrtn', raise if row `row`'s weights are not all zero: Σw² is zero only because
    each square underflows float32, and "the weights sum to zero" would be false."""
    if feature.table.combiner != "sqrtn" or csr.weights is None:
        return
    row_weights = csr.weights[csr.splits[row]:csr.splits[row + 1]]
    if not np.any(row_weights):
        return
    raise ValueError(
        f"Feature {feature.name!r}: the sum of the squared weights of row {row} (largest "
        f"magnitude {np.max(np.abs(row_weights)):g}) is zero in float32, where the 'sqrtn' "
        f"combiner of table {feature.table.name!r} sums them: weights below "
        f"~{SQUARE_UNDERFLOW:.2g} in magnitude square to 0, so it cannot normalise them. "
        "Scale the row's weights up, drop the row, or use the 'sum' combiner."
    )
