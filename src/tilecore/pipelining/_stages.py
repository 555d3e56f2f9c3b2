"""Ready-made stages: the SparseCore ops of a stacking plan, and an optax TC stage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh

from ..ops import DEFAULT_AXIS, UpdateOptions, lookup, lookup_grad
from ..preprocessing import PreprocessedBatch
from ..stacking import StackingPlan
from ._types import Stages, TcResult, TcStage, Variables


class DenseState(NamedTuple):
    """The dense model's parameters and its optax optimizer state."""

    params: Any
    opt_state: Any

    @classmethod
    def create(cls, params: Any, optimizer: optax.GradientTransformation) -> DenseState:
        """`params` with a fresh `optimizer.init(params)`."""
        return cls(params, optimizer.init(params))


def optax_tc(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, *,
             has_aux: bool = False) -> TcStage:
    """A TC stage from a loss and an optax optimizer; its dense state is a `DenseState`.

    `loss_fn(params, activations, dense_inputs)` returns the scalar loss (or
    `(loss, aux)` with `has_aux`). The stage differentiates it with respect to
    the parameters and the activations at once, applies `optimizer` to the
    parameters, and returns the loss (or `(loss, aux)`) as the step's outputs
    and the activation gradients for the SC backward stage. `sc_forward_aux` is
    ignored and `tc_aux` is None; write your own `TcStage` to use them.
    """

    def tc(state: DenseState, activations: Any, dense_inputs: Any, sc_forward_aux: Any
           ) -> TcResult:
        del sc_forward_aux
        value, (param_grads, activation_grads) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=has_aux)(state.params, activations, dense_inputs)
        updates, opt_state = optimizer.update(param_grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TcResult(value, activation_grads, DenseState(params, opt_state))

    return tc


def sparsecore_stages(plan: StackingPlan, tc: TcStage, *, mesh: Mesh | None = None,
                      axis: str = DEFAULT_AXIS, options: UpdateOptions | None = None) -> Stages:
    """Stages whose SC forward is `tc.ops.lookup` and SC backward `tc.ops.lookup_grad`.

    Activations are per-feature `[batch, dim]` arrays; both aux values are None.
    `options` (`tilecore.ops.UpdateOptions`) go to `lookup_grad` unchanged.
    """

    def sc_forward(batch: PreprocessedBatch, variables: Variables) -> tuple[Any, None]:
        return lookup(plan, batch, variables, mesh=mesh, axis=axis), None

    def sc_backward(batch: PreprocessedBatch, variables: Variables, grads: Any,
                    step: jax.Array, tc_aux: Any) -> tuple[Variables, None]:
        del tc_aux
        updated = lookup_grad(plan, batch, variables, grads, step, mesh=mesh, axis=axis,
                              options=options or UpdateOptions())
        return updated, None

    return Stages(sc_forward=sc_forward, tc=tc, sc_backward=sc_backward)
