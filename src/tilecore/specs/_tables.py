"""Table and feature specifications: frozen, validated values."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import numpy as np

from ._numbers import make_plain
from ._optimizers import SGD, OptimizerSpec
from ._weights_dtype import FLOAT32, weights_dtype

Combiner = Literal["sum", "mean", "sqrtn"]
COMBINERS: tuple[str, ...] = get_args(Combiner)

Initializer = Callable[..., Any]
"""`init(key, shape, dtype) -> array`, called per SparseCore shard (JAX convention)."""


def _check_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind}: name must be a non-empty string, got name={name!r}.")


def _check_count(owner: str, field: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {field} must be an integer >= {minimum}, got {field}={value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
    """Simulated quantization of looked-up rows: clip to [min, max], round to buckets."""

    min_value: float
    max_value: float
    num_buckets: int = 256

    def __post_init__(self) -> None:
        make_plain(self, "min_value", "max_value", "num_buckets")
        if not (math.isfinite(self.min_value) and math.isfinite(self.max_value)):
            raise ValueError(f"QuantizationConfig: bounds must be finite, got {self}.")
        if self.min_value >= self.max_value:
            raise ValueError(
                f"QuantizationConfig: min_value must be < max_value, got "
                f"min_value={self.min_value}, max_value={self.max_value}."
            )
        _check_count("QuantizationConfig", "num_buckets", self.num_buckets, minimum=2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One embedding table.

    Attributes:
      name: unique table name.
      vocab_size: number of rows; valid IDs are `[0, vocab_size)`.
      embedding_dim: row width (padded to a multiple of 8 on the device).
      optimizer: the fused update applied to touched rows.
      combiner: how a sample's IDs are pooled: `sum`, `mean` or `sqrtn`.
      initializer: `init(key, shape, dtype)`, called per shard; None picks the
        library default (truncated normal with stddev 1/√dim).
      max_ids_per_partition: most IDs (after per-sample dedupe) one SparseCore may
        send to one partition of this table per step.
      max_unique_ids_per_partition: most distinct IDs one SparseCore may send to
        one partition per step.
      suggested_coo_buffer_size_per_device: COO buffer size per device; None means
        the theoretical maximum implied by `max_ids_per_partition`.
      quantization: optional simulated quantization of the forward pass.
      weights_dtype: how the table's values are stored: float32 (default),
        `jnp.bfloat16` or `jnp.float16` (half the bytes per looked-up row, as
        FBGEMM's `weights_precision`). Lookups combine rows in float32; updates
        apply the optimizer in float32 and write rows back with stochastic
        rounding (`tilecore.ops.UpdateOptions.rounding_seed`). Optimizer slots stay
        float32. Normalised to a `numpy.dtype`; tables of different dtypes are
        never stacked together.
    """

    name: str
    vocab_size: int
    embedding_dim: int
    optimizer: OptimizerSpec = dataclasses.field(default_factory=SGD)
    combiner: Combiner = "sum"
    initializer: Initializer | None = None
    max_ids_per_partition: int = 256
    max_unique_ids_per_partition: int = 256
    suggested_coo_buffer_size_per_device: int | None = None
    quantization: QuantizationConfig | None = None
    weights_dtype: np.dtype | Any = FLOAT32

    def __post_init__(self) -> None:
        _check_name("TableSpec", self.name)
        owner = f"TableSpec {self.name!r}"
        make_plain(self, "vocab_size", "embedding_dim", "max_ids_per_partition",
                   "max_unique_ids_per_partition", "suggested_coo_buffer_size_per_device")
        object.__setattr__(self, "weights_dtype", weights_dtype(self.weights_dtype, owner))
        _check_count(owner, "vocab_size", self.vocab_size)
        if self.vocab_size >= 2**31:
            raise ValueError(f"{owner}: vocab_size must be < 2**31, got {self.vocab_size}.")
        _check_count(owner, "embedding_dim", self.embedding_dim)
        _check_count(owner, "max_ids_per_partition", self.max_ids_per_partition)
        _check_count(owner, "max_unique_ids_per_partition", self.max_unique_ids_per_partition)
        if self.suggested_coo_buffer_size_per_device is not None:
            _check_count(owner, "suggested_coo_buffer_size_per_device",
                         self.suggested_coo_buffer_size_per_device)
        if self.combiner not in COMBINERS:
            raise ValueError(f"{owner}: combiner must be one of {COMBINERS}, got {self.combiner!r}.")
        if not isinstance(self.optimizer, OptimizerSpec):
            raise TypeError(
                f"{owner}: optimizer must be an OptimizerSpec (e.g. tilecore.SGD()), "
                f"got {self.optimizer!r}."
            )
        if self.initializer is not None and not callable(self.initializer):
            raise TypeError(f"{owner}: initializer must be callable, got {self.initializer!r}.")

    def with_limits(
        self,
        *,
        max_ids_per_partition: int | None = None,
        max_unique_ids_per_partition: int | None = None,
        suggested_coo_buffer_size_per_device: int | None = None,
    ) -> TableSpec:
        """A copy with the given limits replaced (None keeps the current value)."""
        changes = {
            "max_ids_per_partition": max_ids_per_partition,
            "max_unique_ids_per_partition": max_unique_ids_per_partition,
            "suggested_coo_buffer_size_per_device": suggested_coo_buffer_size_per_device,
        }
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """One input feature, looked up in `table`.

    Attributes:
      name: unique feature name; the key of this feature's inputs and activations.
      table: the table its IDs index.
      input_shape: global `(batch, max_ids_per_sample)` of the input.
      output_shape: global activation shape, `(batch, embedding_dim)` by default.
    """

    name: str
    table: TableSpec
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_name("FeatureSpec", self.name)
        owner = f"FeatureSpec {self.name!r}"
        if not isinstance(self.table, TableSpec):
            raise TypeError(f"{owner}: table must be a TableSpec, got {type(self.table).__name__}.")
        if not isinstance(self.input_shape, tuple | list):
            raise ValueError(
                f"{owner}: input_shape must be a tuple such as (batch, ids_per_sample), got "
                f"input_shape={self.input_shape!r}."
            )
        make_plain(self, "input_shape", "output_shape")
        input_shape = tuple(self.input_shape)
        if not input_shape or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in input_shape
        ):
            raise ValueError(f"{owner}: input_shape must be positive integers, got {input_shape}.")
        if not isinstance(self.output_shape, tuple | list):
            raise ValueError(
                f"{owner}: output_shape must be a tuple such as (batch, dim), got "
                f"output_shape={self.output_shape!r}."
            )
        output_shape = tuple(self.output_shape) or (input_shape[0], self.table.embedding_dim)
        if len(output_shape) < 2 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in output_shape
        ):
            raise ValueError(
                f"{owner}: output_shape must be >= 2 positive integers, got {output_shape}."
            )
        if math.prod(output_shape[:-1]) != input_shape[0]:
            raise ValueError(
                f"{owner}: input_shape={input_shape} and output_shape={output_shape} disagree on "
                f"the global batch: {input_shape[0]} input rows, "
                f"{math.prod(output_shape[:-1])} activation rows (output_shape[:-1])."
            )
        if output_shape[-1] != self.table.embedding_dim:
            raise ValueError(
                f"{owner}: output_shape[-1]={output_shape[-1]} differs from the embedding_dim="
                f"{self.table.embedding_dim} of table {self.table.name!r}."
            )
        object.__setattr__(self, "input_shape", input_shape)
        object.__setattr__(self, "output_shape", output_shape)

    @property
    def batch_size(self) -> int:
        """Global number of samples (activation rows) of this feature."""
        return math.prod(self.output_shape[:-1])
