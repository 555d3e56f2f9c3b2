"""Reference-compatible entry points (`jax_tpu_embedding.sparsecore.lib.nn.embedding`).

Port a reference script by replacing `jax_tpu_embedding.sparsecore` with
`tilecore.compat` in its imports. Names, arguments, defaults, return layouts and
in-place updates follow the reference (0.2.0); the work is done by tilecore's
stacking, preprocessing and ops.

Differences worth knowing:
- `num_sc_per_device=None` means 4 (tilecore's default logical SparseCores per
  device), not "ask the TPU"; any power of two ≥ 1 is accepted.
- Inputs are validated (IDs outside the vocabulary, non-finite weights, rows that
  do not split over the SparseCores, mean/sqrtn rows whose weights sum to zero)
  and raise `ValueError`/`TypeError`; limits exceeded without
  `allow_id_dropping` raise `tilecore.LimitExceededError` instead of aborting.
- Entries of the COO buffers outside the row-pointer ranges hold filler
  (`2³¹−1`, NaN) rather than uninitialised memory.
- As in the reference, IDs that overflow a too-small
  `suggested_coo_buffer_size_per_device` are dropped even without
  `allow_id_dropping` (counted, with an `IdDroppingWarning`); native tilecore
  raises instead.
- `update_preprocessing_parameters` never sets a limit below 1 or a suggested
  buffer below `8·num_sc_per_device` (the reference can set 0).
- `enable_minibatching=True` splits a batch that exceeds the limits into
  minibatches, with results identical to one pass with unlimited limits; across
  processes the split is agreed through JAX's distributed runtime.
- Device functions (`init_embedding_variables`, `tpu_sparse_dense_matmul`,
  `tpu_sparse_dense_matmul_grad`, `unstack_embedding_activations`,
  `stack_embedding_gradients`) run on any JAX backend over `tilecore.ops`. As in
  the reference they may be called per device inside `shard_map`; they also
  accept global arrays outside `shard_map` (see `tpu_sparse_dense_matmul`).
  `label` and `use_*_primitive` are accepted and ignored (XLA fuses that work).
- As in the reference, the proto helpers of `embedding_proto_utils`
  (`create_proto_from_feature_specs`, `get_optimizer_class`/`_type`,
  `optimizer_spec_to_proto`, `proto_to_optimizer_spec`) are re-exported here.
- Feature specs may come in any pytree of dicts, `Mapping`s (e.g. a
  `flax.core.FrozenDict`), lists and tuples; a spec that appears twice is one
  feature, as in the reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .... import stacking as native_stacking
from ....preprocessing import coo_buffer_size_per_device, row_pointers_size_per_device
from ....preprocessing._errors import FdoStatsError
from ....preprocessing._limits import MINIBATCHING_FACTOR
from ....preprocessing._observed import check_counts
from ....stacking import round_up
from ..._device_api import EmbeddingVariables as EmbeddingVariables
from ..._device_api import init_embedding_variables as init_embedding_variables
from ..._device_api import stack_embedding_gradients as stack_embedding_gradients
from ..._device_api import tpu_sparse_dense_matmul as tpu_sparse_dense_matmul
from ..._device_api import tpu_sparse_dense_matmul_grad as tpu_sparse_dense_matmul_grad
from ..._device_api import unstack_embedding_activations as unstack_embedding_activations
from ..._inputs import as_input, coo_to_ragged
from ..._native import (
    build_plan,
    feature_leaves,
    native_features,
    record_stack,
    resolve_num_sc_per_device,
    topology,
)
from ..._preprocessing import check_options, run
from ..._pytree import assert_same_structure
from ..._results import PreprocessedInput as PreprocessedInput
from ..._results import SparseDenseMatmulInput as SparseDenseMatmulInput
from ..._results import SparseDenseMatmulInputStats as SparseDenseMatmulInputStats
from ..._results import to_reference
from ..._specs import FeatureSpec, StackedTableSpec, TableSpec
from ..._utils_embedding import EmbeddingVariablesInitializer as EmbeddingVariablesInitializer
from ..._utils_embedding import get_all_reduce_interface as get_all_reduce_interface
from ..._utils_embedding import sharding_strategy_to_enum as sharding_strategy_to_enum
from . import embedding_spec as embedding_spec
from . import table_stacking as table_stacking
from .embedding_proto_utils import (
    create_proto_from_feature_specs as create_proto_from_feature_specs,
)
from .embedding_proto_utils import get_optimizer_class as get_optimizer_class
from .embedding_proto_utils import get_optimizer_type as get_optimizer_type
from .embedding_proto_utils import optimizer_spec_to_proto as optimizer_spec_to_proto
from .embedding_proto_utils import proto_to_optimizer_spec as proto_to_optimizer_spec
from .table_stacking import LimitsCallable as LimitsCallable
from .table_stacking import get_default_limits as get_default_limits

T = TypeVar("T")
Nested = T | Sequence[T] | Mapping[str, T]
ArrayLike = Any

__all__ = [
    "EmbeddingVariables",
    "EmbeddingVariablesInitializer",
    "LimitsCallable",
    "PreprocessedInput",
    "SparseDenseMatmulInput",
    "SparseDenseMatmulInputStats",
    "auto_stack_tables",
    "compute_coo_buffer_size_per_device",
    "compute_row_pointers_size_per_device",
    "compute_theoretical_max_coo_buffer_size",
    "create_proto_from_feature_specs",
    "eval_preprocess_sparse_dense_matmul_input_shape",
    "get_all_reduce_interface",
    "get_default_limits",
    "get_optimizer_class",
    "get_optimizer_type",
    "get_stacked_table_specs",
    "get_table_specs",
    "init_embedding_variables",
    "optimizer_spec_to_proto",
    "prepare_feature_specs_for_training",
    "preprocess_sparse_dense_matmul_input",
    "preprocess_sparse_dense_matmul_input_from_sparse_tensor",
    "proto_to_optimizer_spec",
    "sharding_strategy_to_enum",
    "stack_embedding_gradients",
    "tpu_sparse_dense_matmul",
    "tpu_sparse_dense_matmul_grad",
    "unstack_embedding_activations",
    "update_preprocessing_parameters",
]

def get_table_specs(feature_specs: Nested[FeatureSpec]) -> dict[str, TableSpec]:
    """Table name → TableSpec of every feature (duplicate names raise ValueError)."""
    return {f.table_spec.name: f.table_spec for f in feature_leaves(feature_specs)}


def get_stacked_table_specs(feature_specs: Nested[FeatureSpec]) -> dict[str, StackedTableSpec]:
    """Stack name → StackedTableSpec; the features must be prepared for training."""
    specs = feature_leaves(feature_specs)
    if any(not f.table_spec.is_stacked() for f in specs):
        raise ValueError("embedding.prepare_feature_specs_for_training was not called")
    return {
        f.table_spec.stacked_table_spec.stack_name: f.table_spec.stacked_table_spec
        for f in specs
    }


def prepare_feature_specs_for_training(
    feature_specs: Nested[FeatureSpec],
    global_device_count: int,
    num_sc_per_device: int | None = None,
) -> None:
    """Give every not-yet-stacked table its own stack, updating `feature_specs` in place.

    Features sharing such a table are feature-stacked in name order. Tables
    already stacked (by `auto_stack_tables` or `table_stacking.stack_tables`) are
    left alone.
    """
    specs = feature_leaves(feature_specs)
    topo = topology(global_device_count, num_sc_per_device)
    by_table: dict[str, list[FeatureSpec]] = {}
    for feature in specs:
        if not feature.table_spec.is_stacked():
            by_table.setdefault(feature.table_spec.name, []).append(feature)
    for table_name, features in by_table.items():
        stack_name = features[0].table_spec.setting_in_stack.stack_name
        if stack_name != table_name:
            raise ValueError(
                f"Invalid stacking. Table {table_name} does not have StackedTableSpec populated, "
                f"but feature.table_spec.setting_in_stack.stack_name ({stack_name}) is not "
                f"{table_name}."
            )
        plan = native_stacking.stack_tables(native_features(features), topo)
        record_stack(features, plan, table_name, keep_suggested_coo_buffer_size=True)


def auto_stack_tables(
    feature_specs: Nested[FeatureSpec],
    global_device_count: int,
    num_sc_per_device: int | None = None,
    stack_to_max_ids_per_partition: LimitsCallable = get_default_limits,
    stack_to_max_unique_ids_per_partition: LimitsCallable = get_default_limits,
    use_short_stack_names: bool = True,
    *,
    activation_mem_bytes_limit: int | None = None,
) -> None:
    """Stack compatible tables automatically, updating `feature_specs` in place.

    See `table_stacking.auto_stack_tables`; `activation_mem_bytes_limit=None`
    means 2 MiB.
    """
    extra = {} if activation_mem_bytes_limit is None else {
        "activation_mem_bytes_limit": activation_mem_bytes_limit
    }
    table_stacking.auto_stack_tables(
        feature_specs, global_device_count, resolve_num_sc_per_device(num_sc_per_device),
        stack_to_max_ids_per_partition=stack_to_max_ids_per_partition,
        stack_to_max_unique_ids_per_partition=stack_to_max_unique_ids_per_partition,
        use_short_stack_names=use_short_stack_names, **extra,
    )


def compute_row_pointers_size_per_device(
    *,
    global_device_count: int,
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
) -> int:
    """Row pointers per device: `max(N, 8)` per SparseCore (×64 with minibatching)."""
    return row_pointers_size_per_device(topology(global_device_count, num_sc_per_device),
                                        enable_minibatching=enable_minibatching)


def compute_theoretical_max_coo_buffer_size(
    max_ids_per_partition: int,
    global_device_count: int,
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
) -> int:
    """COO entries per device when every partition of every SparseCore is full:
    `roundup8(max_ids_per_partition)·S·N` (×64 with minibatching: one per minibatch)."""
    topo = topology(global_device_count, num_sc_per_device)
    factor = MINIBATCHING_FACTOR if enable_minibatching else 1
    return round_up(max_ids_per_partition, 8) * topo.sc_per_device * topo.num_partitions * factor


def compute_coo_buffer_size_per_device(
    feature_specs: Nested[FeatureSpec],
    global_device_count: int,
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
) -> dict[str, int]:
    """Stack name → COO buffer entries per device (the suggested size rounded up to
    `8·S`, else the theoretical maximum)."""
    plan = build_plan(feature_specs, global_devices=global_device_count,
                      sc_per_device=num_sc_per_device)
    return {name: coo_buffer_size_per_device(stack, plan.topology,
                                             enable_minibatching=enable_minibatching)
            for name, stack in plan.stacks.items()}


def _preprocess(
    inputs: list[Any],
    weights: list[Any] | None,
    specs: list[FeatureSpec],
    feature_specs: Any,
    local_device_count: int,
    global_device_count: int,
    num_sc_per_device: int | None,
    has_leading_dimension: bool,
    allow_id_dropping: bool,
    num_minibatches_dtype: Any,
    minibatching: tuple[bool, int, Any] = (False, 0, None),
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    enable_minibatching, batch_number, agreement = minibatching
    plan = build_plan(
        feature_specs, global_devices=global_device_count, sc_per_device=num_sc_per_device,
        local_devices=local_device_count, enable_minibatching=enable_minibatching,
    )
    named = {spec.name: as_input(value) for spec, value in zip(specs, inputs, strict=True)}
    named_weights = (None if weights is None
                     else {spec.name: as_input(w) for spec, w in zip(specs, weights, strict=True)})
    batch, stats = run(plan, named, named_weights, allow_id_dropping=allow_id_dropping,
                       has_leading_dimension=has_leading_dimension, batch_number=batch_number,
                       agreement=agreement)
    return to_reference(batch, stats, local_device_count,
                        has_leading_dimension=has_leading_dimension,
                        num_minibatches_dtype=num_minibatches_dtype)


def preprocess_sparse_dense_matmul_input(
    features: Nested[ArrayLike],
    features_weights: Nested[ArrayLike] | None,
    feature_specs: Nested[FeatureSpec],
    local_device_count: int,
    global_device_count: int,
    *,
    num_sc_per_device: int | None = None,
    sharding_strategy: str = "MOD",
    has_leading_dimension: bool = False,
    allow_id_dropping: bool = False,
    batch_number: int = 0,
    enable_minibatching: bool = False,
    all_reduce_interface: Any = None,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """Preprocess this process's batch into per-stack packed COO buffers and statistics.

    Args:
      features: a pytree shaped like `feature_specs`; each leaf holds this
        process's rows of one feature: a dense 2-D integer array, or a 1-D object
        array of 1-D integer arrays (ragged).
      features_weights: None (unit weights) or a pytree like `features` of float weights.
      feature_specs: the prepared (stacked) feature specs.
      local_device_count / global_device_count: devices of this process / of all.
      num_sc_per_device: SparseCores per device (None: 4).
      sharding_strategy: only "MOD".
      has_leading_dimension: buffers shaped `(local_devices, size)` instead of flat.
      allow_id_dropping: drop IDs over the limits instead of raising.
      batch_number: the batch's number, the same on every process (minibatching
        agrees on each batch's split).
      enable_minibatching: split a batch whose IDs exceed the limits into up to 64
        minibatches (by hash bucket) instead of raising or dropping; the buffers are
        sized for 64 minibatches (`compute_coo_buffer_size_per_device(...,
        enable_minibatching=True)`).
      all_reduce_interface: how processes agree on the split: None for one
        process, or a `tilecore.distributed.DistributedAgreement` (what
        `get_all_reduce_interface` returns) in a multi-process job.

    Returns:
      `(PreprocessedInput, SparseDenseMatmulInputStats)` laid out as the reference's.
    """
    check_options(sharding_strategy, "preprocess_sparse_dense_matmul_input")
    specs = feature_leaves(feature_specs)
    inputs = assert_same_structure(features, feature_specs, "features", "feature_specs")
    weights = None
    if features_weights is not None:
        weights = assert_same_structure(
            features_weights, feature_specs, "features_weights", "feature_specs"
        )
    return _preprocess(
        inputs, weights, specs, feature_specs, local_device_count, global_device_count,
        num_sc_per_device, has_leading_dimension, allow_id_dropping, None,
        (enable_minibatching, batch_number, all_reduce_interface),
    )


def preprocess_sparse_dense_matmul_input_from_sparse_tensor(
    indices: Nested[ArrayLike],
    values: Nested[ArrayLike],
    dense_shapes: Nested[ArrayLike],
    feature_specs: Nested[FeatureSpec],
    local_device_count: int,
    global_device_count: int,
    *,
    num_sc_per_device: int | None = None,
    sharding_strategy: str = "MOD",
    has_leading_dimension: bool = False,
    allow_id_dropping: bool = False,
    batch_number: int = 0,
    enable_minibatching: bool = False,
    all_reduce_interface: Any = None,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """Preprocess TF-style sparse tensors (`indices [n, 2]`, ID `values [n]`, `dense_shape`).

    Weights are always 1 (use `preprocess_sparse_dense_matmul_input` for weights);
    the other arguments are those of `preprocess_sparse_dense_matmul_input`.
    """
    check_options(sharding_strategy, "preprocess_sparse_dense_matmul_input_from_sparse_tensor")
    specs = feature_leaves(feature_specs)
    idx = assert_same_structure(indices, feature_specs, "indices", "feature_specs")
    vals = assert_same_structure(values, feature_specs, "values", "feature_specs")
    shapes = assert_same_structure(dense_shapes, feature_specs, "dense_shapes", "feature_specs")
    inputs = [coo_to_ragged(spec.name, i, v, s)
              for spec, i, v, s in zip(specs, idx, vals, shapes, strict=True)]
    return _preprocess(
        inputs, None, specs, feature_specs, local_device_count, global_device_count,
        num_sc_per_device, has_leading_dimension, allow_id_dropping, np.int32,
        (enable_minibatching, batch_number, all_reduce_interface),
    )


def eval_preprocess_sparse_dense_matmul_input_shape(
    feature_specs: Nested[FeatureSpec],
    local_device_count: int,
    global_device_count: int,
    *,
    num_sc_per_device: int | None = None,
    has_leading_dimension: bool = False,
    enable_minibatching: bool = False,
) -> PreprocessedInput:
    """The shapes and dtypes of the preprocessed input, as `jax.ShapeDtypeStruct`s.

    As in the reference, the buffers are described flat `(local_devices·size,)`.
    """
    import jax  # deferred: ShapeDtypeStruct is a JAX type

    sizes = compute_coo_buffer_size_per_device(
        feature_specs, global_device_count, num_sc_per_device, enable_minibatching
    )
    pointers = compute_row_pointers_size_per_device(
        global_device_count=global_device_count, num_sc_per_device=num_sc_per_device,
        enable_minibatching=enable_minibatching,
    )

    def struct(size: int, dtype: Any) -> Any:
        return jax.ShapeDtypeStruct((local_device_count * size,), dtype)

    minibatches_shape = (local_device_count, 1) if has_leading_dimension else (local_device_count,)
    return PreprocessedInput(
        SparseDenseMatmulInput(
            lhs_row_pointers={name: struct(pointers, np.int32) for name in sizes},
            lhs_embedding_ids={name: struct(size, np.int32) for name, size in sizes.items()},
            lhs_sample_ids={name: struct(size, np.int32) for name, size in sizes.items()},
            lhs_gains={name: struct(size, np.float32) for name, size in sizes.items()},
        ),
        jax.ShapeDtypeStruct(minibatches_shape, np.int32),
    )


def update_preprocessing_parameters(
    feature_specs: Nested[FeatureSpec],
    updated_params: SparseDenseMatmulInputStats,
    num_sc_per_device: int,
) -> None:
    """Set each stack's limits from observed statistics, updating `feature_specs` in place.

    For every stack named in `updated_params`: `max_ids_per_partition` and
    `max_unique_ids_per_partition` become the largest observed counts, and
    `suggested_coo_buffer_size_per_device` the largest per-SparseCore requirement ×
    `num_sc_per_device` (stacks it does not name keep their values). Unlike the
    reference, limits never drop below 1 and the buffer below `8·num_sc_per_device`.
    Re-jit device code that takes the specs as static arguments afterwards.
    Unlike the reference, statistics that cannot be counts of these stacks (another
    type, a stack the specs lack, negative, non-integer, empty or beyond int32
    counts) raise `FdoStatsError` before any spec changes.
    """
    _check_stats(feature_specs, updated_params)
    for feature in feature_leaves(feature_specs):
        if not feature.table_spec.is_stacked():
            raise ValueError(
                f"Feature {feature.name!r} is not stacked: call "
                "embedding.prepare_feature_specs_for_training first."
            )
        stacked = feature.table_spec.stacked_table_spec
        name = stacked.stack_name
        max_ids = updated_params.max_ids_per_partition.get(name, stacked.max_ids_per_partition)
        max_unique = updated_params.max_unique_ids_per_partition.get(
            name, stacked.max_unique_ids_per_partition
        )
        buffer = updated_params.get_required_buffer_size_per_device(name, num_sc_per_device)
        if buffer is None:
            buffer = stacked.suggested_coo_buffer_size_per_device
        else:
            buffer = max(buffer, 8 * (num_sc_per_device or 1))
        feature.table_spec.stacked_table_spec = dataclasses.replace(
            stacked,
            max_ids_per_partition=max(1, int(np.max(max_ids))),
            max_unique_ids_per_partition=max(1, int(np.max(max_unique))),
            suggested_coo_buffer_size_per_device=buffer,
        )



def _check_stats(feature_specs: Nested[FeatureSpec], stats: Any) -> None:
    """`stats` may set the limits of `feature_specs`' stacks (see
    `update_preprocessing_parameters`), else FdoStatsError."""
    where = "update_preprocessing_parameters: the statistics"
    if not isinstance(stats, SparseDenseMatmulInputStats):
        raise FdoStatsError(f"{where} must be the SparseDenseMatmulInputStats that "
                            f"preprocessing returns, got {type(stats).__name__}.")
    stacks = {f.table_spec.stacked_table_spec.stack_name for f in feature_leaves(feature_specs)
              if f.table_spec.is_stacked()}
    fix = "Pass the statistics that preprocessing these feature specs returned."
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition",
                  "required_buffer_size_per_sc"):
        for name, values in getattr(stats, field).items():
            if name not in stacks:
                raise FdoStatsError(f"{where} name stack {name!r}, which is not one of the "
                                    f"specs' stacks {sorted(stacks)}. {fix}")
            check_counts(np.asarray(values), f"{where}: stack {name!r} ({field})", fix)
