"""Backward pass fused with the optimizer: per-row gradients, then the row update."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ..preprocessing import PreprocessedBatch, StackBuffers
from ..specs._numbers import is_integer
from ..stacking import StackingPlan
from . import _checks as checks
from ._activations import feature_gradients
from ._contract import VARIABLES_REMEDY, check_call, check_clip, check_names, check_step
from ._eager import ByIdentity, device_arrays, should_jit
from ._layout import StackLayout, stack_layouts
from ._lookup import DEFAULT_AXIS, num_minibatches_of, on_mesh
from ._per_device import lookup_grad_stack
from ._variables import EmbeddingVariables


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateOptions:
    """How `lookup_grad` applies the optimizers (the defaults: as the reference does).

    Attributes:
      clip: stack name → (min, max) applied to the table values after the update
        (never to slots).
      check_finite: fail the computation if an updated table or slot holds NaN or
        Inf (a debugging aid): a host callback raises `FloatingPointError` naming the
        stack, which JAX hands on as a `jax.errors.JaxRuntimeError` holding that
        message, when the result is computed.
      serialize_stacks: update the stacks one after another, so that only one
        stack's temporaries are alive at a time (lower peak memory, less overlap).
      rounding_seed: seed of the stochastic rounding that writes updated rows into
        bfloat16/float16 tables (`TableSpec.weights_dtype`), an integer in [0, 2**64).
        The random bits are a hash of (seed, stack, step, row, column): the same seed
        and steps give bit-identical tables, each device's rows get their own bits,
        and no random state is carried. Unused by float32 tables.
    """

    clip: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    check_finite: bool = False
    serialize_stacks: bool = False
    rounding_seed: int = 0

    def __post_init__(self) -> None:
        seed = self.rounding_seed
        if not is_integer(seed) or not 0 <= int(seed) < 2**64:
            raise ValueError(f"UpdateOptions: rounding_seed must be an integer in [0, 2**64), "
                             f"got rounding_seed={seed!r}.")
        object.__setattr__(self, "rounding_seed", int(seed))
        check_clip("UpdateOptions: clip", self.clip)

    def __hash__(self) -> int:
        # By value, as `==` compares (a static argument of the jitted eager call).
        return hash((tuple((name, tuple(bounds)) for name, bounds in sorted(self.clip.items())),
                     self.check_finite, self.serialize_stacks, self.rounding_seed))


DEFAULT_OPTIONS = UpdateOptions()
"""`lookup_grad`'s default options."""


def lookup_grad(
    plan: StackingPlan,
    batch: PreprocessedBatch,
    variables: Mapping[str, EmbeddingVariables],
    activation_grads: Mapping[str, jax.Array],
    step: Any = 0,
    *,
    mesh: Mesh | None = None,
    axis: str = DEFAULT_AXIS,
    stacked: bool = False,
    options: UpdateOptions = DEFAULT_OPTIONS,
) -> dict[str, EmbeddingVariables]:
    """Apply each stack's optimizer to the rows the batch touched.

    Per touched row `g = Σ gain · grad[sample]` over every entry of the step (all
    devices), then the stack's update rule on those rows only; untouched rows
    and slots are unchanged. Donate `variables` (jit `donate_argnums`) to update
    in place.

    Args:
      activation_grads: feature name → `[batch, dim]` gradients of the
        activations `lookup` returned (stack name → stacked block if `stacked`).
      step: the global 0-based step (schedules, Adam/LaProp bias correction).
      options: clipping, finiteness checks and stack ordering (`UpdateOptions`).
    """
    layouts = stack_layouts(plan)
    check_call(plan, batch, mesh, axis, "lookup_grad")
    check_names("lookup_grad", "the variables", variables, plan.stacks, VARIABLES_REMEDY)
    check_names("lookup_grad", "the activation gradients", activation_grads,
                plan.stacks if stacked else plan.features,
                "Pass the gradients of the activations lookup returned"
                + (" (stacked=True: one per stack)." if stacked else " (one per feature)."))
    _check_clip_ranges(plan, options)
    check_step(step)
    variables, activation_grads = device_arrays((dict(variables), dict(activation_grads)))
    if should_jit(batch, variables, activation_grads, step):
        return _compiled_lookup_grad(ByIdentity(plan), batch, dict(variables),
                                     dict(activation_grads), step, mesh=mesh, axis=axis,
                                     stacked=stacked, options=options)
    per_device = functools.partial(_update_device, plan, options, stacked,
                                   None if mesh is None else axis)
    tables = {name: variables[name] for name in layouts}
    step = jnp.asarray(step, jnp.int32)  # one compiled program whatever the step's Python type
    count = num_minibatches_of(batch)
    if mesh is None:
        return per_device(batch.stacks, tables, activation_grads, step, count)
    sharded = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(PartitionSpec(axis), PartitionSpec(axis), PartitionSpec(axis), PartitionSpec(),
                  PartitionSpec()),
        out_specs=PartitionSpec(axis), check_vma=False,
    )
    stacks, tables, grads = on_mesh(mesh, axis, dict(batch.stacks), tables, dict(activation_grads))
    return sharded(stacks, tables, grads, step, count)


def _check_clip_ranges(plan: StackingPlan, options: UpdateOptions) -> None:
    """Each clipped stack exists and its bounds fit its table's dtype (a bound the table
    cannot hold would write the values clipped to it as inf)."""
    unknown = sorted(set(options.clip) - set(plan.stacks))
    if unknown:
        raise ValueError(f"clip names unknown stacks {unknown}; stacks: {sorted(plan.stacks)}.")
    for name, (low, high) in options.clip.items():
        dtype = np.dtype(plan.stacks[name].weights_dtype)
        largest = float(jnp.finfo(dtype).max)
        if any(math.isfinite(b) and abs(b) > largest for b in (low, high)):
            raise ValueError(f"clip[{name!r}] = {(low, high)} reaches beyond the {dtype.name} "
                             f"values of stack {name!r}'s table (at most {largest:g} in size).")


def _update_device(plan: StackingPlan, options: UpdateOptions, stacked: bool, axis: str | None,
                   buffers: Mapping[str, StackBuffers], tables: Mapping[str, EmbeddingVariables],
                   grads: Mapping[str, jax.Array], step: Any, num_minibatches: jax.Array
                   ) -> dict[str, EmbeddingVariables]:
    """One device's new variables of every stack (inside `shard_map` over a mesh): the
    stacks one after another with `serialize_stacks`, else as XLA schedules them."""
    def inputs(name: str) -> tuple[StackBuffers, Any, EmbeddingVariables]:
        features = plan.stacks[name].feature_names
        return (buffers[name], grads[name] if stacked else {f: grads[f] for f in features},
                tables[name])

    layouts = stack_layouts(plan)
    work = [(functools.partial(_update_stack, plan, layout, options, stacked, axis, step,
                               num_minibatches), inputs(name))
            for name, layout in layouts.items()]
    results = (checks.one_after_another(work) if options.serialize_stacks
               else [update(stack_inputs) for update, stack_inputs in work])
    return dict(zip(layouts, results, strict=True))


def _update_stack(plan: StackingPlan, layout: StackLayout, options: UpdateOptions,
                  stacked: bool, axis: str | None, step: Any, num_minibatches: jax.Array,
                  inputs: tuple[StackBuffers, Any, EmbeddingVariables]) -> EmbeddingVariables:
    """One stack's new variables on one device from its buffers, its activations'
    gradients (its features', or its stacked block) and its variables."""
    stack_buffers, stack_grads, stack_variables = inputs
    name = layout.name
    if stacked:
        grads, slices = [stack_grads], None
    else:
        grads, slices = feature_gradients(plan, name, stack_grads, layout)
    new = lookup_grad_stack(
        stack_buffers, grads, stack_variables, layout, plan.stacks[name].optimizer, step, axis,
        options.clip.get(name), num_minibatches, options.rounding_seed, slices)
    if options.check_finite:
        checks.check_finite([new.table, *new.slots], stack=name, what="updated variables")
    return new


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("mesh", "axis", "stacked", "options"))
def _compiled_lookup_grad(plan: ByIdentity[StackingPlan], batch: PreprocessedBatch,
                          variables: Mapping[str, EmbeddingVariables],
                          activation_grads: Mapping[str, jax.Array], step: Any, **options: Any
                          ) -> dict[str, EmbeddingVariables]:
    """`lookup_grad` called eagerly, as one program (`_eager`)."""
    return lookup_grad(plan.value, batch, variables, activation_grads, step, **options)
