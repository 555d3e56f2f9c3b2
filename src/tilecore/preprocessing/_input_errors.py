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
