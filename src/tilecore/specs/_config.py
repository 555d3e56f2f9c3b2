"""Host-side knobs of the SparseCore system (seed 000 §4), grouped in one value."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ._numbers import make_plain, plain

DEFAULT_ACTIVATION_MEM_BYTES_LIMIT = 2 * 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseCoreConfig:
    """How tables are stacked and how preprocessing treats limits.

    Attributes:
      disable_table_stacking: keep every table in its own stack (features that
        share a table are still stacked).
      allow_id_dropping: when a partition's IDs exceed its limits, drop the excess
        (counted and warned about) instead of raising.
      max_ids_per_chip_per_sample: if set, a sample may send at most this many IDs
        (over all features) to one device; more raises. None disables the check
        (the TPU flag defaults to 64; on other hardware the limit is opt-in).
      max_ids_per_table / max_unique_ids_per_table: per-table budgets over all
        partitions; a table listed here gets per-partition limits of
        `ceil(budget / N)`, replacing its TableSpec's.
      activation_mem_bytes_limit: auto-stacking starts a new stack when the stacked
        activations would exceed this many bytes per SparseCore.
      enable_minibatching: when a partition's IDs exceed its limits, split the
        batch into minibatches by a hash of the row (every occurrence of a row in
        one minibatch) instead of raising or dropping. Changes the buffer layout
        even when one minibatch suffices, as on the reference system.
    """

    disable_table_stacking: bool = False
    allow_id_dropping: bool = False
    max_ids_per_chip_per_sample: int | None = None
    max_ids_per_table: Mapping[str, int] | None = None
    max_unique_ids_per_table: Mapping[str, int] | None = None
    activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
    enable_minibatching: bool = False

    def __post_init__(self) -> None:
        make_plain(self, "max_ids_per_chip_per_sample", "activation_mem_bytes_limit")
        for field in ("max_ids_per_table", "max_unique_ids_per_table"):
            budgets = getattr(self, field)
            if isinstance(budgets, Mapping) and any(plain(v) is not v for v in budgets.values()):
                object.__setattr__(self, field, {k: plain(v) for k, v in budgets.items()})
        for flag in ("disable_table_stacking", "allow_id_dropping", "enable_minibatching"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(
                    f"SparseCoreConfig: {flag} must be True or False, got {getattr(self, flag)!r}."
                )
        limit = self.activation_mem_bytes_limit
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(
                f"SparseCoreConfig: activation_mem_bytes_limit must be an integer, got {limit!r}."
            )
        per_sample = self.max_ids_per_chip_per_sample
        if per_sample is not None and (isinstance(per_sample, bool) or not isinstance(
                per_sample, int) or per_sample < 1):
            raise ValueError(
                "SparseCoreConfig: max_ids_per_chip_per_sample must be an integer >= 1 or None, got "
                f"{self.max_ids_per_chip_per_sample!r}."
            )
        for field in ("max_ids_per_table", "max_unique_ids_per_table"):
            for table, budget in (getattr(self, field) or {}).items():
                if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                    raise ValueError(
                        f"SparseCoreConfig: {field}[{table!r}] must be an integer >= 1, "
                        f"got {budget!r}."
                    )
        if self.activation_mem_bytes_limit < 1:
            raise ValueError(
                "SparseCoreConfig: activation_mem_bytes_limit must be >= 1, got "
                f"{self.activation_mem_bytes_limit!r}."
            )
