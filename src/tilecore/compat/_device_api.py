"""The reference's device functions, over `tilecore.ops` (JAX is imported on first call).

`tilecore.compat.embedding` re-exports these; see `_device` for how a call finds
whether it runs per device inside `shard_map` or on global arrays.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from ._auto_pipelining_hook import LOOKUP_MARK, UPDATE_MARK, markable
from ._native import feature_leaves, resolve_num_sc_per_device
from ._specs import FeatureSpec, TableSpec

T = TypeVar("T")
Nested = T | Sequence[T] | Mapping[str, T]


class EmbeddingVariables(NamedTuple):
    """A stacked table `[N·R, padded_dim]` and its optimizer slots (the optimizer's
    slot named tuple, e.g. `AdagradSlotVariables(accumulator=...)`).

    The same rows layout as `tilecore.ops.EmbeddingVariables(table, slots)`;
    the compat device functions accept either.
    """

    table: Any
    slot: tuple[Any, ...]


def init_embedding_variables(
    rng: Any,
    table_specs: Nested[TableSpec],
    global_sharding: Any,
    num_sparsecore_per_device: int | None = None,
    bypass_mesh_check: bool = False,
) -> dict[str, EmbeddingVariables]:
    """Initial variables of every stack, as the reference creates them.

    Args:
      rng: a JAX PRNG key; split into `mesh.size·S` keys per stack, one per
        SparseCore shard, shared by the stack's tables.
      table_specs: the (stacked) table specs, e.g. `get_table_specs(feature_specs)`.
      global_sharding: `NamedSharding(mesh, P(axis, None))` (jit: tables
        `[stack_vocab, padded_dim]`) or `P(axis, None, None)` (pmap: tables
        `[devices, stack_vocab/devices, padded_dim]`).
      num_sparsecore_per_device: S (None: 4).
      bypass_mesh_check: allow a mesh whose device order differs from `jax.devices()`.

    Returns:
      Stack name → `EmbeddingVariables(table, slot)`; each table initializer is
      called per shard with shape `(padded_vocab/N, padded_dim)`, padding included.

    Raises:
      ValueError: a stack of several tables prepared for another number of
        partitions than `mesh.size·S` (its tables' rows would mix), rows that do
        not split over them, or a never-prepared table whose sizes are not padded
        for them (`_variables_layout`; the reference accepts these in silence).
    """
    from ._variables import init_variables

    return init_variables(rng, table_specs, global_sharding, num_sparsecore_per_device,
                          bypass_mesh_check, EmbeddingVariables)


def unstack_embedding_activations(
    activations: Mapping[str, Any],
    feature_specs: Nested[FeatureSpec],
    global_device_count: int,
    num_sc_per_device: int | None = None,
    use_activation_unstack_primitive: bool = False,
) -> Nested[Any]:
    """Per-feature activations (shaped like `feature_specs`) from per-stack ones.

    Per device (`[S·samples_per_sc, dim]` → `[B_f/G, output_dim]`), as in the
    reference; global stacked activations (`[G·S·samples_per_sc, dim]`) give global
    `[B_f, output_dim]`. `use_activation_unstack_primitive` is ignored (XLA fuses the
    unstacking on every backend).
    """
    del use_activation_unstack_primitive
    from ._activations import unstack

    return unstack(activations, feature_specs, global_device_count,
                   resolve_num_sc_per_device(num_sc_per_device))


def stack_embedding_gradients(
    activation_gradients: Nested[Any],
    feature_specs: Nested[FeatureSpec],
    num_sc_per_device: int | None = None,
    global_device_count: int | None = None,
    use_gradient_stacking_primitive: bool = False,
) -> dict[str, Any]:
    """Per-stack gradients from per-feature ones (the inverse of unstacking).

    Per device (`[B_f/G, dim]` each), as in the reference; with
    `global_device_count` given, global `[B_f, dim]` gradients are accepted too.
    Columns are zero-padded to the stack's width. `use_gradient_stacking_primitive` is
    ignored (XLA fuses the stacking on every backend).
    """
    del use_gradient_stacking_primitive
    from ._activations import stack

    return stack(activation_gradients, feature_specs,
                 resolve_num_sc_per_device(num_sc_per_device), global_device_count)


def _check_call(preprocessed_inputs: Any, embedding_variables: Mapping[str, Any],
                feature_specs: Any, sharding_strategy: str, enable_minibatching: bool,
                what: str) -> Any:
    from ._device import matmul_input_parts
    from ._preprocessing import check_options
    from ._results import PreprocessedInput, SparseDenseMatmulInput

    check_options(sharding_strategy, what)
    if not isinstance(preprocessed_inputs, PreprocessedInput | SparseDenseMatmulInput):
        raise TypeError(f"{what}: preprocessed_inputs must be the PreprocessedInput that "
                        "preprocess_sparse_dense_matmul_input returned, got "
                        f"{type(preprocessed_inputs).__name__}.")
    if isinstance(preprocessed_inputs, SparseDenseMatmulInput):
        warnings.warn("SparseDenseMatmulInput is deprecated. Please use PreprocessedInput "
                      "instead.", DeprecationWarning, stacklevel=3)
    num_minibatches = getattr(preprocessed_inputs, "num_minibatches", None)
    if enable_minibatching and num_minibatches is None:
        raise ValueError(
            f"{what}: enable_minibatching=True needs the minibatch count; pass the "
            "PreprocessedInput that preprocess_sparse_dense_matmul_input returned (not its "
            "sparse_dense_matmul_input)."
        )
    parts = matmul_input_parts(preprocessed_inputs)
    stacks = {f.table_spec.stacked_table_spec.stack_name for f in feature_leaves(feature_specs)
              if f.table_spec.is_stacked()}
    for name, keys in (("the preprocessed inputs", parts.lhs_row_pointers.keys()),
                       ("embedding_variables", embedding_variables.keys())):
        if set(keys) != stacks:
            raise ValueError(
                f"{what}: {name} hold stacks {sorted(keys)} but the feature specs define "
                f"{sorted(stacks)}; preprocess and initialise with these feature specs."
            )
    return parts, (1 if num_minibatches is None else num_minibatches)


def _plan(feature_specs: Any, global_device_count: int, num_sc_per_device: int | None,
          enable_minibatching: bool) -> Any:
    from ._native import build_plan

    return build_plan(feature_specs, global_devices=global_device_count,
                      sc_per_device=num_sc_per_device, enable_minibatching=enable_minibatching)


@markable(LOOKUP_MARK, data=("preprocessed_inputs",))
def tpu_sparse_dense_matmul(
    preprocessed_inputs: Any,
    embedding_variables: Mapping[str, Any],
    feature_specs: Nested[FeatureSpec],
    *,
    global_device_count: int,
    sharding_strategy: str = "MOD",
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
    perform_unstacking: bool = True,
    use_activation_unstack_primitive: bool = False,
    mesh: Any = None,
) -> Any:
    """The embedding activations: for each sample, `Σ gain · table[row]` over its IDs.

    As in the reference, call it per device inside `shard_map` over the mesh
    (`in_specs=P(axis)`, `out_specs=P(axis)`): each call sees one device's flat
    buffers and table shard and returns that device's `[B_f/G, output_dim]`
    activations; the collectives run over the shard_map's axes. Outside
    `shard_map`, pass global arrays: flat `[local_devices·size]` (or
    `[local_devices, size]`) buffers and tables sharded by rows over a mesh;
    compat maps the per-device work over that mesh (taken from `mesh`, else the
    tables' sharding, else `jax.set_mesh`) and returns global `[B_f, output_dim]`.

    Args:
      preprocessed_inputs: a `PreprocessedInput` (or a deprecated
        `SparseDenseMatmulInput`) from `preprocess_sparse_dense_matmul_input`.
      embedding_variables: stack name → `EmbeddingVariables(table, slot)` (or
        `tilecore.ops.EmbeddingVariables`).
      feature_specs: the prepared feature specs the inputs were preprocessed with.
      global_device_count: G, devices over all processes (typically `mesh.size`).
      sharding_strategy: only "MOD".
      num_sc_per_device: S (None: 4); must match preprocessing.
      enable_minibatching: the inputs were preprocessed with minibatching (the
        buffers hold up to 64 minibatches, read one after another).
      perform_unstacking: per-feature activations (True) or stack name → stacked
        activations `[S·samples_per_sc, dim]` per device (False).
      use_activation_unstack_primitive: ignored.
      mesh: (compat only) the mesh for global calls over several devices.

    Returns:
      Activations shaped like `feature_specs`, or per stack without unstacking.
    """
    del use_activation_unstack_primitive
    from . import _device
    from ._activations import unstack

    what = "tpu_sparse_dense_matmul"
    parts, minibatches = _check_call(preprocessed_inputs, embedding_variables, feature_specs,
                                     sharding_strategy, enable_minibatching, what)
    plan = _plan(feature_specs, global_device_count, num_sc_per_device, enable_minibatching)
    tables = {name: embedding_variables[name][0] for name in plan.stacks}
    where = _device.placement(global_device_count, next(iter(tables.values())), mesh)
    axis = where.axis

    def per_device(parts: Any, tables: Any, minibatches: Any) -> Any:
        stacks = {name: _device.buffers(parts, name) for name in plan.stacks}
        blocks = _device.lookup_stacks(plan, stacks, tables, axis, minibatches)
        if not perform_unstacking:
            return blocks
        return unstack(blocks, feature_specs, global_device_count, plan.topology.sc_per_device)

    return _device.run_placed(where, per_device, parts, tables, minibatches)


@markable(UPDATE_MARK, data=("activation_gradients", "preprocessed_inputs", "step"))
def tpu_sparse_dense_matmul_grad(
    activation_gradients: Nested[Any],
    preprocessed_inputs: Any,
    embedding_variables: Mapping[str, Any],
    feature_specs: Nested[FeatureSpec],
    *,
    global_device_count: int | None = None,
    sharding_strategy: str = "MOD",
    label: str = "",
    step: Any = None,
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
    perform_stacking: bool = True,
    use_gradient_stacking_primitive: bool = False,
    embedding_var_limits: Mapping[str, tuple[float, float]] | None = None,
    mesh: Any = None,
) -> dict[str, EmbeddingVariables]:
    """The **updated** variables: per touched row `g = Σ gain · activation_grad[sample]`
    over all devices, then each stack's optimizer on those rows only.

    Called per device inside `shard_map` or on global arrays, as
    `tpu_sparse_dense_matmul` (whose arguments these share). Donate
    `embedding_variables` under `jit` to update them in place.

    Args:
      activation_gradients: gradients shaped like `feature_specs` (or, without
        `perform_stacking`, stack name → stacked gradients).
      global_device_count: G (None: the shard_map's axis size, or 1 outside it).
      label: ignored (the reference names its kernels with it).
      use_gradient_stacking_primitive: ignored (XLA fuses the stacking).
      step: the global 0-based step (Adam's and LaProp's bias correction, schedules);
        None means 0. A Python int or a traced scalar.
      embedding_var_limits: stack name → (min, max) applied to the updated table
        values (never to slots).

    Returns:
      Stack name → `EmbeddingVariables(table, slot)` with the slot container kept.
    """
    del label, use_gradient_stacking_primitive
    from . import _device
    from ._activations import stack

    what = "tpu_sparse_dense_matmul_grad"
    parts, minibatches = _check_call(preprocessed_inputs, embedding_variables, feature_specs,
                                     sharding_strategy, enable_minibatching, what)
    if global_device_count is None:
        global_device_count = _device.context_device_count()
    plan = _plan(feature_specs, global_device_count, num_sc_per_device, enable_minibatching)
    from ..ops._contract import check_clip, check_step

    check_clip(f"{what}: embedding_var_limits", embedding_var_limits or {})
    if step is not None:
        check_step(step)
    clip = dict(embedding_var_limits or {})
    unknown = sorted(set(clip) - set(plan.stacks))
    if unknown:
        raise ValueError(f"{what}: embedding_var_limits names unknown stacks {unknown}; "
                         f"stacks: {sorted(plan.stacks)}.")
    variables = {name: (v[0], tuple(v[1])) for name, v in embedding_variables.items()}
    where = _device.placement(global_device_count, variables[next(iter(plan.stacks))][0], mesh)
    s = plan.topology.sc_per_device

    def per_device(parts: Any, variables: Any, grads: Any, minibatches: Any, step: Any) -> Any:
        if perform_stacking:
            grads = stack(grads, feature_specs, s, global_device_count)
        stacks = {name: _device.buffers(parts, name) for name in plan.stacks}
        return _device.update_stacks(plan, stacks, variables, grads, step, where.axis, clip,
                                     minibatches)

    updated = _device.run_placed(where, per_device, parts, variables, activation_gradients,
                                 minibatches, 0 if step is None else step, replicated=1)
    out = {}
    for name, (table, slots) in updated.items():
        old = embedding_variables[name][1]
        slot = type(old)(*slots) if hasattr(old, "_fields") else tuple(slots)
        out[name] = EmbeddingVariables(table, slot)
    return out
