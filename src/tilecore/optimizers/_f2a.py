"""Frequency-aware Adagrad (F2A): Adagrad whose step grows for rarely updated rows."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def f2a(
    grad: jax.Array,
    row: jax.Array,
    accumulator: jax.Array,
    local_step: jax.Array,
    learning_rate: Any,
    rho: Any,
    l1: Any,
    l2: Any,
    max_lr_multiplier: Any,
    global_step: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One F2A step on gathered rows `[rows, dim]`.

    `local_step` counts how often each row was updated; `global_step` is the step
    the spec's hyperparameters were taken at (a Python int or a traced integer).

    .. math::
        n' &= n + 1, \\qquad
        f = \\min\\big((\\max(t, 1) / n')^{\\rho},\\ \\text{max\\_lr\\_multiplier}\\big) \\\\
        a' &= a + g^2 \\\\
        w' &= w - \\eta\\,\\big(f\\, g / \\sqrt{a'} + l_1 \\operatorname{sign}(w) + l_2\\, w\\big)
    """
    new_local_step = local_step + 1.0
    ratio = jnp.maximum(jnp.asarray(global_step, jnp.float32), 1.0) / new_local_step
    multiplier = jnp.minimum(jnp.power(ratio, rho), max_lr_multiplier)
    new_accumulator = accumulator + grad * grad
    update = grad * multiplier / jnp.sqrt(new_accumulator) + l1 * jnp.sign(row) + l2 * row
    return row - learning_rate * update, new_accumulator, new_local_step
