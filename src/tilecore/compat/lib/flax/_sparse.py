"""What the reference's linen and nnx `SparseCoreEmbed` share.

The reference's layers return, as the "gradient" of their embedding parameter,
the *updated* variables (REFERENCE.md gotcha 12): the lookup's VJP runs the
fused sparse update. `DeviceCall.lookup_updating` reproduces that contract, and
like the reference's layers it calls the device functions
(`tpu_sparse_dense_matmul` forward, `tpu_sparse_dense_matmul_grad` backward), so
a train step built from the layers is one that `lib.auto_pipelining` can split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import FrozenDict, unfreeze
from jax.sharding import Mesh

from ....stacking import StackingPlan
from ..._device_api import tpu_sparse_dense_matmul, tpu_sparse_dense_matmul_grad
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


def as_float32(variables: Any) -> Any:
    """`variables` with every leaf in float32 (the lookup and update run in float32).
    Raises for a leaf that is not floating point: its activations would come back
    truncated to its integer type."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(f"The embedding variable {jax.tree_util.keystr(path)} has dtype "
                             f"{leaf.dtype}; tables and slots must be floating point "
                             "(float32, bfloat16 or float16).")
    return jax.tree.map(lambda x: x if x.dtype == jnp.float32 else x.astype(jnp.float32),
                        variables)


def like_dtypes(values: Any, originals: Any) -> Any:
    """`values` cast leaf by leaf to the dtypes of `originals` (same structure)."""
    return jax.tree.map(lambda v, o: v if v.dtype == o.dtype else v.astype(o.dtype),
                        values, originals)


def in_table_dtypes(feature_specs: Any, acts: Any, variables: Any) -> Any:
    """Each feature's activation in the dtype of its stack's table (mixed precision)."""

    def cast(spec: Any, act: jax.Array) -> jax.Array:
        stack = spec.table_spec.stacked_table_spec.stack_name
        dtype = jax.tree.leaves(variables[stack])[0].dtype
        return act if act.dtype == dtype else act.astype(dtype)

    specs = plain_specs(feature_specs)
    values = assert_same_structure(acts, specs, "activations", "feature_specs")
    cast_values = iter([cast(spec, act) for spec, act in zip(leaves(specs), values, strict=True)])
    return map_leaves(lambda _: next(cast_values), specs)


@dataclasses.dataclass(frozen=True)
class DeviceCall:
    """What a layer passes to the device functions besides inputs and variables."""

    feature_specs: Any
    global_device_count: int
    num_sc_per_device: int
    sharding_strategy: str
    enable_minibatching: bool
    mesh: Mesh | None  # None on one device

    def lookup(self, preprocessed: Any, variables: Any) -> Any:
        """Activations shaped like the specs (`tpu_sparse_dense_matmul`; plain JAX
        differentiation, no custom VJP)."""
        return tpu_sparse_dense_matmul(
            preprocessed, variables, plain_specs(self.feature_specs),
            global_device_count=self.global_device_count,
            sharding_strategy=self.sharding_strategy, num_sc_per_device=self.num_sc_per_device,
            enable_minibatching=self.enable_minibatching, mesh=self.mesh)

    def update(self, preprocessed: Any, variables: Any, grads: Any, step: Any) -> Any:
        """The variables (in their own containers) after one fused update with the
        activation gradients `grads` (`tpu_sparse_dense_matmul_grad`)."""
        updated = tpu_sparse_dense_matmul_grad(
            plain_specs(grads), preprocessed, variables, plain_specs(self.feature_specs),
            global_device_count=self.global_device_count,
            sharding_strategy=self.sharding_strategy, step=step,
            num_sc_per_device=self.num_sc_per_device,
            enable_minibatching=self.enable_minibatching, mesh=self.mesh)
        return _like(updated, variables)

    def lookup_updating(self, preprocessed: Any, variables: Any, step: Any) -> Any:
        """Activations shaped like the specs; the VJP for `variables` is the *updated*
        variables (the reference's contract)."""

        @jax.custom_vjp
        def forward(variables: Any) -> Any:
            return self.lookup(preprocessed, variables)

        def forward_with_residuals(variables: Any) -> tuple[Any, Any]:
            return forward(variables), variables

        def backward(variables: Any, grads: Any) -> tuple[Any]:
            return (self.update(preprocessed, variables, grads, step),)

        forward.defvjp(forward_with_residuals, backward)
        return forward(variables)


def _like(updated: Mapping[str, Any], variables: Any) -> Any:
    """`updated` (stack → (table, slot)) in the containers of `variables`."""
    flat = [leaf for name in sorted(updated) for leaf in jax.tree.leaves(tuple(updated[name]))]
    return jax.tree.unflatten(jax.tree.structure(variables), flat)
