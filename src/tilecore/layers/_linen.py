"""A Flax linen embedding layer over `tilecore.ops`, and the sparse half of a train step.

The layer keeps its stacked tables and optimizer slots in their own collection,
`"embeddings"`, apart from the dense `"params"`: optax never sees them, and no
gradient as large as a table is ever formed. Its activations carry an all-zero
*probe* from the `"probes"` collection (`tilecore.ops.embed`), so the gradient of
the loss with respect to `variables["probes"]` is exactly the activation
gradients, which `update_embeddings` turns into fused sparse table updates.

One jit-able train step, dense params by optax and tables by their own optimizer::

    model = DLRM(plan)                      # any module that calls LinenEmbed(plan)
    variables = model.init(key, batch)      # {"params", "embeddings", "probes"}
    tx = optax.adam(1e-3)
    opt_state = tx.init(variables["params"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(variables, opt_state, batch, labels, step):
        def loss_fn(params, probes):
            logits = model.apply({**variables, "params": params, "probes": probes}, batch)
            return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

        loss, (grads, activation_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            variables["params"], variables["probes"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        embeddings = update_embeddings(model, variables, activation_grads, step, batch)
        params = optax.apply_updates(variables["params"], updates)
        return {**variables, "params": params, "embeddings": embeddings}, opt_state, loss

Batches come from `LinenEmbed(plan).preprocess(inputs)` on the host, outside `jit`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..ops import DEFAULT_AXIS, activation_probe, embed, init_tables, lookup_grad
from ..ops._contract import check_step
from ..preprocessing import PreprocessedBatch, PreprocessStats, preprocess
from ..stacking import StackingPlan
from ._checks import (
    check_activation_grads,
    check_batch,
    check_mesh,
    check_plan,
    check_variables,
)

EMBEDDINGS = "embeddings"
"""Collection of the stacked tables and slots: `{stack: EmbeddingVariables}` per layer."""
PROBES = "probes"
"""Collection of the zero probes whose gradients are the activation gradients."""
ACTIVATION_GRADS = "activation_grads"
"""Collection `update_embeddings` passes the activation gradients (and step) in."""
TABLES = "tables"
"""Name of a layer's `{stack: EmbeddingVariables}` in the `"embeddings"` collection."""
_ACTIVATIONS, _STEP = "activations", "step"


class LinenEmbed(nn.Module):
    """Per-feature embedding activations from a preprocessed batch (Flax linen).

    Attributes:
      plan: the stacking plan (features, tables, stacks, topology).
      mesh: the device mesh the tables and batches are split over; None for one device.
      axis: the mesh axis the tables are sharded over by rows.
      init_on_host: compute the initial tables on the CPU, then transfer them.

    `model.init` creates `variables["embeddings"]` (this layer's `{stack:
    EmbeddingVariables}`, under its module path) and `variables["probes"]`.
    Applying the model returns `{feature: [batch, embedding_dim]}`; see the module
    docstring for the train step.
    """

    plan: StackingPlan
    mesh: Mesh | None = None
    axis: str = DEFAULT_AXIS
    init_on_host: bool = False

    def preprocess(self, inputs: Mapping[str, Any], weights: Mapping[str, Any] | None = None,
                   **kwargs: Any) -> tuple[PreprocessedBatch, PreprocessStats]:
        """`tilecore.preprocess` with this layer's plan (host side; needs no `apply`)."""
        return preprocess(self.plan, inputs, weights, **kwargs)

    def _where(self) -> str:
        path = "/".join(self.scope.path) if self.scope is not None else "(unbound)"
        return f"LinenEmbed {path!r}"

    def setup(self) -> None:
        check_plan(self.plan, self._where())
        check_mesh(self.plan, self.mesh, self.axis, self._where())
        if not (self.is_initializing() or self.has_variable(EMBEDDINGS, TABLES)):
            raise ValueError(
                f"{self._where()}: no embedding tables; the variables passed to apply lack the "
                f"{EMBEDDINGS!r} collection (it has {sorted(self.variables)}). Initialise with "
                "model.init and pass every collection it returned, e.g. model.apply("
                "{**variables, 'params': params}, batch)."
            )
        self.tables = self.variable(EMBEDDINGS, TABLES, lambda: init_tables(
            self.plan, self.make_rng("params"), mesh=self.mesh, axis=self.axis,
            on_host=self.init_on_host))
        check_variables(self.plan, self.tables.value, self._where())
        # Without probes (inference) the activations are the same, with no gradient path.
        self.probe = (self.variable(PROBES, _ACTIVATIONS, self._zeros)
                      if self.is_initializing() or self.has_variable(PROBES, _ACTIVATIONS)
                      else None)

    def _zeros(self) -> dict[str, jax.Array]:
        return activation_probe(self.plan, mesh=self.mesh, axis=self.axis)

    def __call__(self, batch: PreprocessedBatch) -> dict[str, jax.Array]:
        """`{feature: [batch, embedding_dim]}` activations of `batch`.

        Inside `update_embeddings` (the `"activation_grads"` collection is present)
        this applies the sparse update instead and returns zeros.
        """
        check_batch(self.plan, batch, self._where())
        if self.has_variable(ACTIVATION_GRADS, _ACTIVATIONS):
            step = (self.get_variable(ACTIVATION_GRADS, _STEP)
                    if self.has_variable(ACTIVATION_GRADS, _STEP) else 0)
            self.update(batch, self.get_variable(ACTIVATION_GRADS, _ACTIVATIONS), step)
            return self._zeros()
        probe = self._zeros() if self.probe is None else self.probe.value
        return embed(self.plan, batch, self.tables.value, probe, mesh=self.mesh, axis=self.axis)

    def update(self, batch: PreprocessedBatch, activation_grads: Mapping[str, jax.Array],
               step: Any = 0) -> None:
        """Apply each stack's optimizer to the rows `batch` touched (`tilecore.ops.lookup_grad`).

        Needs `mutable=["embeddings"]`. `update_embeddings` calls it for every
        layer of a model; call it directly (`apply(..., method="update")`) when the
        layer is the top-level module.
        """
        check_batch(self.plan, batch, self._where())
        check_activation_grads(self.plan, activation_grads, self._where())
        if not self.is_mutable_collection(EMBEDDINGS):
            raise ValueError(
                f"{self._where()}: updating the tables needs apply(..., mutable="
                f"[{EMBEDDINGS!r}]); use update_embeddings(model, variables, grads, step, ...)."
            )
        self.tables.value = lookup_grad(self.plan, batch, self.tables.value,
                                        dict(activation_grads), step, mesh=self.mesh,
                                        axis=self.axis)


def _with_step(tree: Any, step: jax.Array) -> tuple[Any, int]:
    """The probe gradients with `step` beside every layer's activations; and the layer count."""
    if not isinstance(tree, Mapping):
        return tree, 0
    inner = tree.get(_ACTIVATIONS)
    if isinstance(inner, Mapping) and not any(isinstance(v, Mapping) for v in inner.values()):
        return {**tree, _STEP: step}, 1
    out, count = {}, 0
    for key, value in tree.items():
        out[key], found = _with_step(value, step)
        count += found
    return out, count


def update_embeddings(model: nn.Module, variables: Mapping[str, Any], activation_grads: Any,
                      step: Any, *args: Any, **apply_kwargs: Any) -> dict[str, Any]:
    """The `"embeddings"` collection after every `LinenEmbed` of `model` applied its update.

    Args:
      model: the model whose `LinenEmbed` layers produced the activations.
      variables: the model's variables (all collections, as for `model.apply`).
      activation_grads: the gradient with respect to `variables["probes"]`.
      step: the global 0-based step (learning-rate schedules, Adam's bias correction).
      *args, **apply_kwargs: the arguments the forward pass was applied with (the
        batch first, then e.g. dense features, `rngs=`).

    The model runs again with the gradients in the `"activation_grads"` collection:
    each layer updates its tables (`tilecore.ops.lookup_grad`) and returns zeros,
    so under `jit` the rest of that pass is dead code that XLA removes.
    """
    if not isinstance(activation_grads, Mapping):
        raise TypeError("activation_grads must be the gradient with respect to "
                        f"variables[{PROBES!r}] (a dict), got {type(activation_grads).__name__}.")
    check_step(step)  # before the cast below, which would take 1.5 for 1
    grads, layers = _with_step(activation_grads, jnp.asarray(step, jnp.int32))
    if layers == 0:
        raise ValueError(
            f"activation_grads holds no layer's activation gradients (keys "
            f"{sorted(activation_grads)}); pass jax.grad of the loss with respect to "
            f"variables[{PROBES!r}], the collection model.init created."
        )
    _, mutated = model.apply({**variables, ACTIVATION_GRADS: grads}, *args,
                             mutable=[EMBEDDINGS], **apply_kwargs)
    return dict(mutated[EMBEDDINGS])

