"""Differentiating a model through the lookup, and the one-call training update.

The tables are not trained by autodiff: a dense gradient over a table would be
as large as the table. Instead the lookup adds an all-zero *probe* to its
activations, and its custom VJP hands the activation gradients to the probe's
cotangent, returning no cotangent for tables or buffers. `jax.grad` with
respect to the probe therefore yields exactly the activation gradients, which
`lookup_grad` turns into sparse, fused table updates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..preprocessing import PreprocessedBatch
from ..stacking import StackingPlan
from ._contract import check_names
from ._lookup import DEFAULT_AXIS, lookup
from ._lookup_grad import lookup_grad
from ._placement import explicit_axis, place_rows
from ._variables import EmbeddingVariables


def activation_probe(plan: StackingPlan, *, mesh: Mesh | None = None,
                     axis: str = DEFAULT_AXIS) -> dict[str, jax.Array]:
    """Zeros shaped (and, on a mesh, sharded by rows) like every feature's activations."""
    device = None if mesh is None else NamedSharding(mesh, PartitionSpec(axis))
    return place_rows({name: jnp.zeros((f.batch_size, f.table.embedding_dim), jnp.float32,
                                       device=device)
                       for name, f in plan.features.items()}, mesh, axis)


def embed(
    plan: StackingPlan,
    batch: PreprocessedBatch,
    variables: Mapping[str, EmbeddingVariables | jax.Array],
    probe: Mapping[str, jax.Array],
    *,
    mesh: Mesh | None = None,
    axis: str = DEFAULT_AXIS,
) -> dict[str, jax.Array]:
    """Per-feature activations; their gradients flow to `probe` (see `activation_probe`).

    `jax.grad(model, argnums=<probe>)` returns the activation gradients that
    `lookup_grad` consumes. Tables and buffers get no gradient (updating the
    tables is `lookup_grad`'s job), so no table-sized gradient is ever formed.
    `probe` must map every feature to an array of its activations' shape.
    """
    check_names("embed", "the probe's arrays", probe, plan.features,
                "Pass activation_probe(plan) (zeros of each feature's activation shape).")
    for name, feature in plan.features.items():
        want = (feature.batch_size, feature.table.embedding_dim)
        if tuple(jnp.shape(probe[name])) != want:
            raise ValueError(f"embed: the probe of feature {name!r} has shape "
                             f"{tuple(jnp.shape(probe[name]))}; expected {want} (its "
                             "activations'). Pass activation_probe(plan).")

    # The tables and the batch are arguments, not closed over: a `jax.grad` taken with
    # respect to them (say, to all of a Flax model's variables) made them tracers that
    # the rule could not hold (JAX's UnexpectedTracerError). Their cotangent is a
    # symbolic zero (None), never a table-sized array.
    @jax.custom_vjp
    def with_probe(variables: Any, batch: PreprocessedBatch,
                   probe: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        out = lookup(plan, batch, variables, mesh=mesh, axis=axis)
        return {name: out[name] + probe[name] for name in out}

    def forward(variables: Any, batch: PreprocessedBatch, probe: Mapping[str, jax.Array]
                ) -> tuple[dict[str, jax.Array], None]:
        return with_probe(variables, batch, probe), None

    # Under an explicitly sharded mesh a cotangent must carry its input's sharding.
    specs: dict[str, NamedSharding] = {}
    if mesh is not None and explicit_axis(mesh, axis):
        specs = {name: NamedSharding(mesh, jax.typeof(p).sharding.spec)
                 for name, p in probe.items()}

    def backward(_: None, grads: dict[str, jax.Array]) -> tuple[None, None, dict[str, jax.Array]]:
        return None, None, {name: jax.reshard(g, specs[name]) if specs else g
                            for name, g in grads.items()}

    with_probe.defvjp(forward, backward)
    return with_probe(dict(variables), batch, dict(probe))


def training_update(
    plan: StackingPlan,
    batch: PreprocessedBatch,
    variables: Mapping[str, EmbeddingVariables],
    loss_fn: Callable[[Any, dict[str, jax.Array]], jax.Array],
    params: Any,
    step: Any = 0,
    *,
    mesh: Mesh | None = None,
    axis: str = DEFAULT_AXIS,
) -> tuple[jax.Array, Any, dict[str, EmbeddingVariables]]:
    """One training step's gradient work: `(loss, dense gradients, updated variables)`.

    `loss_fn(params, activations)` is the dense model and loss. Its gradient with
    respect to `params` is returned for the dense optimizer (e.g. optax); the
    activation gradients go straight into `lookup_grad`, which applies each
    stack's optimizer to the touched rows. Donate `variables` when jitting.
    """

    def loss_of(params: Any, probe: Mapping[str, jax.Array]) -> jax.Array:
        return loss_fn(params, embed(plan, batch, variables, probe, mesh=mesh, axis=axis))

    loss, (param_grads, activation_grads) = jax.value_and_grad(loss_of, argnums=(0, 1))(
        params, activation_probe(plan, mesh=mesh, axis=axis))
    updated = lookup_grad(plan, batch, variables, activation_grads, step, mesh=mesh, axis=axis)
    return loss, param_grads, updated
