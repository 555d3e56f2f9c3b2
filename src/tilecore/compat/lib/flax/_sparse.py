"""What the reference's linen and nnx `SparseCoreEmbed` share, over tilecore's native API.

The reference's layers return, as the "gradient" of their embedding parameter,
the *updated* variables (REFERENCE.md gotcha 12): the lookup's VJP runs the
fused sparse update. `lookup` reproduces that contract with `tilecore.ops.lookup`
forward and `tilecore.ops.lookup_grad` backward, on the stacking plan that the
compat feature specs record (`tilecore.compat.embedding.prepare_feature_specs_for_training`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict, unfreeze
from jax.sharding import Mesh

from .... import ops
from ....preprocessing import PreprocessedBatch
from ....stacking import StackingPlan
from ..._device import buffers, matmul_input_parts, minibatch_count
from ..._native import build_plan
from ..._preprocessing import check_options
from ..._pytree import assert_same_structure, leaves, map_leaves


def plain_specs(feature_specs: Any) -> Any:
    """The feature specs with linen's `FrozenDict`s turned back into dicts."""
    return unfreeze(feature_specs) if isinstance(feature_specs, FrozenDict) else feature_specs


def single_axis(sharding_axis: Any, layer: str) -> str:
    """The one mesh axis tables are sharded over (tilecore shards over one axis)."""
    if isinstance(sharding_axis, str):
        return sharding_axis
    axes = tuple(sharding_axis)
    if len(axes) == 1 and isinstance(axes[0], str):
        return axes[0]
    raise NotImplementedError(
        f"{layer}: sharding_axis={sharding_axis!r}; tilecore shards tables over a single mesh "
        "axis. Build a mesh with one axis for the embedding shards (e.g. reshape the devices)."
    )


def make_plan(feature_specs: Any, global_devices: int, num_sc_per_device: int | None,
              sharding_strategy: str, enable_minibatching: bool, layer: str) -> StackingPlan:
    """The native plan of the prepared compat feature specs for `global_devices`."""
    check_options(sharding_strategy, layer)
    return build_plan(plain_specs(feature_specs), global_devices=global_devices,
                      sc_per_device=num_sc_per_device, enable_minibatching=enable_minibatching)


def native_batch(plan: StackingPlan, preprocessed: Any, layer: str) -> PreprocessedBatch:
    """The native batch view of a reference `PreprocessedInput` (no copies)."""
    parts = matmul_input_parts(preprocessed)
    found = sorted(getattr(parts, "lhs_row_pointers", {}) or {})
    if found != sorted(plan.stacks):
        raise ValueError(
            f"{layer}: the preprocessed input holds stacks {found} but the feature specs "
            f"describe stacks {sorted(plan.stacks)}; preprocess with this layer "
            "(layer.preprocess_inputs(...)) or with the same feature specs."
        )
    count = getattr(preprocessed, "num_minibatches", None)
    if plan.config.enable_minibatching and count is None:
        raise ValueError(
            f"{layer}: the layer minibatches, so it needs the minibatch count: pass the "
            "PreprocessedInput from layer.preprocess_inputs(...), not its sparse_dense_matmul_input."
        )
    return PreprocessedBatch(stacks={name: buffers(parts, name) for name in plan.stacks},
                             num_minibatches=_one_count(count))


def _one_count(count: Any) -> int:
    """Every device's minibatch count from the reference's per-device `num_minibatches`:
    a Python int for host values, a device scalar for (traced) JAX arrays."""
    if count is None:
        return 1
    if isinstance(count, int | np.integer | np.ndarray):
        return int(np.asarray(count).reshape(-1)[0])
    return cast(int, minibatch_count(count))


def native_variables(variables: Mapping[str, Any]) -> dict[str, ops.EmbeddingVariables]:
    """Reference `(table, slot)` pairs as `tilecore.ops.EmbeddingVariables`."""
    return {name: ops.EmbeddingVariables(v[0], tuple(v[1])) for name, v in variables.items()}


def like(updated: Mapping[str, ops.EmbeddingVariables], variables: Mapping[str, Any]) -> Any:
    """`updated` in the containers of `variables` (its mapping, pair and slot types)."""
    flat = [leaf for name in sorted(updated)  # jax.tree's order: sorted stacks, table, slots
            for leaf in (updated[name].table, *updated[name].slots)]
    return jax.tree.unflatten(jax.tree.structure(variables), flat)


def as_float32(variables: Any) -> Any:
    """`variables` with every leaf in float32 (the lookup and update run in float32)."""
    return jax.tree.map(lambda x: x if x.dtype == jnp.float32 else x.astype(jnp.float32),
                        variables)


def like_dtypes(values: Any, originals: Any) -> Any:
    """`values` cast leaf by leaf to the dtypes of `originals` (same structure)."""
    return jax.tree.map(lambda v, o: v if v.dtype == o.dtype else v.astype(o.dtype),
                        values, originals)


def in_table_dtypes(feature_specs: Any, plan: StackingPlan, acts: Any, variables: Any) -> Any:
    """Each feature's activation in the dtype of its stack's table (mixed precision)."""

    def cast(spec: Any, act: jax.Array) -> jax.Array:
        stack = plan.feature_settings[spec.name].stack_name
        dtype = jax.tree.leaves(variables[stack])[0].dtype
        return act if act.dtype == dtype else act.astype(dtype)

    specs = plain_specs(feature_specs)
    values = assert_same_structure(acts, specs, "activations", "feature_specs")
    cast_values = iter([cast(spec, act) for spec, act in zip(leaves(specs), values, strict=True)])
    return map_leaves(lambda _: next(cast_values), specs)


def _by_feature(feature_specs: Any, plan: StackingPlan, grads: Any) -> dict[str, jax.Array]:
    """Nested activation gradients (shaped like the specs) → feature → padded gradient."""
    specs = plain_specs(feature_specs)
    values = assert_same_structure(plain_specs(grads), specs, "gradients", "feature_specs")
    out = {}
    for spec, grad in zip(leaves(specs), values, strict=True):
        dim = plan.features[spec.name].table.embedding_dim
        grad = jnp.asarray(grad, jnp.float32)
        out[spec.name] = jnp.pad(grad, ((0, 0), (0, dim - grad.shape[-1])))
    return out


def activations(feature_specs: Any, plan: StackingPlan, acts: Mapping[str, jax.Array]) -> Any:
    """Feature → activation, shaped like the specs (narrowed to each `output_shape[-1]`)."""
    return map_leaves(lambda spec: acts[spec.name][:, :int(spec.output_shape[-1])],
                      plain_specs(feature_specs))


def update(feature_specs: Any, plan: StackingPlan, batch: PreprocessedBatch, variables: Any,
           grads: Any, step: Any, mesh: Mesh | None, axis: str) -> Any:
    """The updated variables (in the containers of `variables`) after one fused update."""
    updated = ops.lookup_grad(plan, batch, native_variables(variables),
                              _by_feature(feature_specs, plan, grads),
                              0 if step is None else step, mesh=mesh, axis=axis)
    return like(updated, variables)


def lookup_forward(feature_specs: Any, plan: StackingPlan, batch: PreprocessedBatch,
                   variables: Any, mesh: Mesh | None, axis: str) -> Any:
    """Activations shaped like the specs (plain JAX differentiation; no custom VJP)."""
    acts = ops.lookup(plan, batch, native_variables(variables), mesh=mesh, axis=axis)
    return activations(feature_specs, plan, acts)


def lookup(feature_specs: Any, plan: StackingPlan, batch: PreprocessedBatch, variables: Any,
           step: Any, mesh: Mesh | None, axis: str) -> Any:
    """Activations shaped like the specs; the VJP for `variables` is the *updated* variables."""

    @jax.custom_vjp
    def forward(variables: Any) -> Any:
        return lookup_forward(feature_specs, plan, batch, variables, mesh, axis)

    def forward_with_residuals(variables: Any) -> tuple[Any, Any]:
        return forward(variables), variables

    def backward(variables: Any, grads: Any) -> tuple[Any]:
        return (update(feature_specs, plan, batch, variables, grads, step, mesh, axis),)

    forward.defvjp(forward_with_residuals, backward)
    return forward(variables)
