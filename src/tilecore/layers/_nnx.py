"""A Flax nnx embedding layer over `tilecore.ops`, and an optimizer for models using it.

The layer holds its stacked tables and slots in a `Tables` variable and an
all-zero `Probe` shaped like its activations (`tilecore.ops.embed`). Neither is
an `nnx.Param`, so a dense optimizer never touches them. Differentiating with
respect to `PARAMS_AND_PROBES` gives the dense gradients and, on each probe,
the activation gradients; `EmbedOptimizer.update` applies optax to the former
and the fused sparse update (`tilecore.ops.lookup_grad`) to the tables.

One jit-able train step::

    model = DLRM(plan, rngs=nnx.Rngs(0))         # any module holding NnxEmbed(plan, ...)
    optimizer = EmbedOptimizer(model, optax.adam(1e-3))

    @nnx.jit
    def train_step(model, optimizer, batch, labels):
        def loss_fn(model):
            logits = model(batch)
            return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

        grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, PARAMS_AND_PROBES))
        loss, grads = grad_fn(model)
        optimizer.update(model, grads, batch)    # dense: optax; tables: sparse, fused
        return loss

Batches come from `model.embed.preprocess(inputs)` on the host, outside `jit`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.nnx as nnx
import jax
import optax
from jax.sharding import Mesh

from ..ops import DEFAULT_AXIS, activation_probe, embed, init_tables, lookup_grad
from ..preprocessing import PreprocessedBatch, PreprocessStats, preprocess
from ..stacking import StackingPlan
from ._checks import (
    check_activation_grads,
    check_batch,
    check_mesh,
    check_plan,
    check_variables,
)


class Tables(nnx.Variable):
    """A layer's `{stack: EmbeddingVariables}`: stacked tables and optimizer slots."""


class Probe(nnx.Variable):
    """Zeros added to a layer's activations; their gradient is the activation gradient."""


PARAMS_AND_PROBES = nnx.Any(nnx.Param, Probe)
"""What to differentiate with respect to: dense params and every layer's probe."""


class NnxEmbed(nnx.Module):
    """Per-feature embedding activations from a preprocessed batch (Flax nnx).

    Args:
      plan: the stacking plan (features, tables, stacks, topology).
      rngs: `rngs.params()` seeds the tables' initializers.
      mesh: the device mesh the tables and batches are split over; None for one device.
      axis: the mesh axis the tables are sharded over by rows.
      init_on_host: compute the initial tables on the CPU, then transfer them.
    """

    def __init__(self, plan: StackingPlan, *, rngs: nnx.Rngs, mesh: Mesh | None = None,
                 axis: str = DEFAULT_AXIS, init_on_host: bool = False) -> None:
        check_plan(plan, "NnxEmbed")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"NnxEmbed: rngs must be an nnx.Rngs (its params() stream seeds the "
                            f"tables), got {type(rngs).__name__}; pass e.g. nnx.Rngs(0).")
        check_mesh(plan, mesh, axis, "NnxEmbed")
        self.plan = plan
        self.mesh = mesh
        self.axis = axis
        self.tables = Tables(init_tables(plan, rngs.params(), mesh=mesh, axis=axis,
                                         on_host=init_on_host))
        self.probe = Probe(activation_probe(plan, mesh=mesh, axis=axis))

    def preprocess(self, inputs: Mapping[str, Any], weights: Mapping[str, Any] | None = None,
                   **kwargs: Any) -> tuple[PreprocessedBatch, PreprocessStats]:
        """`tilecore.preprocess` with this layer's plan (host side)."""
        return preprocess(self.plan, inputs, weights, **kwargs)

    def __call__(self, batch: PreprocessedBatch) -> dict[str, jax.Array]:
        """`{feature: [batch, embedding_dim]}` activations of `batch`."""
        check_batch(self.plan, batch, "NnxEmbed")
        tables = self.tables.get_value()
        check_variables(self.plan, tables, "NnxEmbed")
        return embed(self.plan, batch, tables, self.probe.get_value(), mesh=self.mesh,
                     axis=self.axis)

    def update(self, batch: PreprocessedBatch, activation_grads: Mapping[str, jax.Array],
               step: Any = 0) -> None:
        """Apply each stack's optimizer to the rows `batch` touched (`tilecore.ops.lookup_grad`)."""
        check_batch(self.plan, batch, "NnxEmbed")
        check_activation_grads(self.plan, activation_grads, "NnxEmbed")
        tables = self.tables.get_value()
        check_variables(self.plan, tables, "NnxEmbed")
        self.tables.set_value(lookup_grad(self.plan, batch, tables, dict(activation_grads),
                                          step, mesh=self.mesh, axis=self.axis))


def _path_name(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path)


def _probe_grads(grads: Any, path: tuple[Any, ...]) -> Mapping[str, jax.Array]:
    node = grads
    for key in (*path, "probe"):
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(
                f"The gradients hold no activation gradients for the NnxEmbed at "
                f"{_path_name(path) or '(root)'!r}: differentiate with respect to its probe too, "
                "e.g. nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, "
                "tilecore.layers.PARAMS_AND_PROBES))."
            )
        node = node[key]
    return node.get_value() if isinstance(node, nnx.Variable) else node


def _check_wrt(model: nnx.Module, wrt: Any) -> None:
    """Refuse a `wrt` filter that hands an NnxEmbed's probe or tables to optax.

    optax would move the probe off zero, which shifts every later activation by it
    without an error, and the tables are updated by the fused sparse update only.
    """
    selects = nnx.filterlib.to_predicate(wrt)
    for path, layer in nnx.iter_modules(model):
        if not isinstance(layer, NnxEmbed):
            continue
        for name in ("probe", "tables"):
            variable = getattr(layer, name)
            if selects((*path, name), variable):
                raise ValueError(
                    f"EmbedOptimizer: wrt={wrt!r} selects the {type(variable).__name__} "
                    f"variable {_path_name((*path, name))!r} of the NnxEmbed at "
                    f"{_path_name(path) or '(root)'!r}; optax would change it (a nonzero probe "
                    "shifts every activation; tables get the fused sparse update). Keep wrt to "
                    "dense params, e.g. the default nnx.Param (differentiate with respect to "
                    "PARAMS_AND_PROBES, but optimize only nnx.Param)."
                )


class EmbedOptimizer(nnx.Optimizer):
    """`nnx.Optimizer` for dense params, plus the sparse update of every `NnxEmbed`.

    `update(model, grads, batch)` takes gradients with respect to
    `PARAMS_AND_PROBES`: the `wrt` part goes to optax, each layer's probe gradient
    to its fused table update at the optimizer's step (0 at the first update).
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *,
                 wrt: Any = nnx.Param) -> None:
        _check_wrt(model, wrt)
        super().__init__(model, tx, wrt=wrt)

    def update(self, model: nnx.Module, grads: Any, /,  # pyright: ignore[reportIncompatibleMethodOverride]
               batch: PreprocessedBatch | Mapping[str, PreprocessedBatch] | None = None,
               **kwargs: Any) -> optax.Updates:
        """Update the dense params and the tables of every `NnxEmbed` in `model`.

        Args:
          batch: the batch the loss was computed on, or layer path (`"a/b"`) → batch
            for a model whose layers read different batches.
        """
        step = self.step[...]
        layers = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, NnxEmbed)]
        if layers and batch is None:
            raise ValueError(
                f"The model has NnxEmbed layers at {[_path_name(p) for p, _ in layers]}; pass "
                "the batch their loss was computed on: optimizer.update(model, grads, batch)."
            )
        for path, layer in layers:
            name = _path_name(path)
            if isinstance(batch, PreprocessedBatch):
                layer_batch = batch
            elif batch is not None and name in batch:
                layer_batch = batch[name]
            else:
                raise ValueError(f"No batch for the NnxEmbed at {name!r}; batches are given for "
                                 f"{sorted(batch or {})}.")
            layer.update(layer_batch, _probe_grads(grads, path), step)
        return super().update(model, grads, **kwargs)
