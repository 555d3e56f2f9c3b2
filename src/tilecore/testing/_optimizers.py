"""A plain numpy oracle of every optimizer update (float64 inside, no JAX).

Written straight from the reference formulas and the specs' fields, independently of
`tilecore.optimizers` and of `OptimizerSpec.hyperparameters`, so it checks both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..specs import (
    F2A,
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    CustomOptimizer,
    LaProp,
    OptimizerSpec,
)


def reference_update(
    spec: OptimizerSpec,
    grad: np.ndarray,
    row: np.ndarray,
    slots: Sequence[np.ndarray],
    step: int,
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """One optimizer step on rows `[rows, dim]`: returns `(new_row, new_slots)` in float64.

    `step` is the 0-based global step (it matters for Adam, LaProp, F2A and
    learning-rate schedules). A `CustomOptimizer`'s `update_fn` is called on the numpy
    arrays; a rule given as StableHLO (`tilecore.optimizers.StableHLORule`) runs in
    JAX, so check it against the oracle of the Python rule it was lowered from.
    """
    g = np.asarray(grad, np.float64)
    w = np.asarray(row, np.float64)
    s = [np.asarray(slot, np.float64) for slot in slots]
    lr = float(spec.learning_rate_at(step))
    if isinstance(spec, CustomOptimizer):
        out = spec.update_fn(g, w, *s, *spec.hyperparameters(step))
        return np.asarray(out[0], np.float64), tuple(np.asarray(x, np.float64) for x in out[1:])
    if isinstance(spec, SGD):
        return w - lr * g, ()
    if isinstance(spec, Adagrad):
        (a,) = s
        a = a + g * g
        return w - lr * g / np.sqrt(a), (a,)
    if isinstance(spec, AdagradMomentum):
        return _adagrad_momentum(spec, lr, g, w, *s)
    if isinstance(spec, Adam):
        return _adam(spec, lr, step, g, w, *s)
    if isinstance(spec, FTRL):
        return _ftrl(spec, lr, g, w, *s)
    if isinstance(spec, LaProp):
        return _laprop(spec, lr, step, g, w, *s)
    if isinstance(spec, F2A):
        return _f2a(spec, lr, step, g, w, *s)
    raise TypeError(f"reference_update has no formula for {type(spec).__name__}.")


Result = tuple[np.ndarray, tuple[np.ndarray, ...]]


def _adagrad_momentum(spec: AdagradMomentum, lr: float, g: Any, w: Any, a: Any, m: Any) -> Result:
    a = a + g * g if spec.beta2 == 1.0 else spec.beta2 * a + (1.0 - spec.beta2) * g * g
    scaled = (a + spec.epsilon) ** (-1.0 / spec.exponent) * g
    m = spec.momentum * m + scaled
    update = spec.momentum * m + scaled if spec.use_nesterov else m
    return w - lr * update, (a, m)


def _adam(spec: Adam, lr: float, step: int, g: Any, w: Any, m: Any, v: Any) -> Result:
    b1, b2 = spec.beta_1, spec.beta_2
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    # Textbook bias correction, m̂ = m/(1−β1^t), v̂ = v/(1−β2^t) with t = step + 1,
    # scaled the way the reference folds it: ε sits outside √v̂ times √(1−β2^t).
    t = step + 1
    m_hat = m / (1.0 - b1**t)
    v_hat = v / (1.0 - b2**t)
    return w - lr * m_hat / (np.sqrt(v_hat) + spec.epsilon), (m, v)


def _ftrl(spec: FTRL, lr: float, g: Any, w: Any, a: Any, lin: Any) -> Result:
    power = -spec.learning_rate_power
    l1, l2, beta = (spec.l1_regularization_strength, spec.l2_regularization_strength,
                    spec.beta)
    new_a = a + g * g
    sigma = new_a**power - a**power
    if spec.multiply_linear_by_learning_rate:
        lin = lin + lr * g - sigma * w
        threshold = l1 * lr
        denominator = new_a**power + 2.0 * lr * l2 + beta
    else:
        lin = lin + g - sigma / lr * w
        threshold = l1
        denominator = (new_a**power + beta) / lr + 2.0 * l2
    if l1 == 0.0:
        numerator = -lin
    else:
        # Soft threshold: zero inside [-threshold, threshold], else shrink toward it.
        numerator = np.where(np.abs(lin) <= threshold, 0.0, -(lin - np.sign(lin) * threshold))
    return numerator / denominator, (new_a, lin)


def _laprop(spec: LaProp, lr: float, step: int, g: Any, w: Any, mu: Any, nu: Any) -> Result:
    b2 = spec.b2
    decay = b2 * (1.0 - b2**step) / (1.0 - b2 ** (step + 1))
    nu = decay * nu + (1.0 - decay) * (g * g + spec.eps)
    mu = spec.b1 * mu + math.sqrt(1.0 - spec.b1**2) * g / np.sqrt(nu)
    return w - lr * mu, (mu, nu)


def _f2a(spec: F2A, lr: float, step: int, g: Any, w: Any, acc: Any, n: Any) -> Result:
    # A row updated n' times by global step t gets its Adagrad step scaled by
    # (t/n')^rho (t counted from 1), capped at max_lr_multiplier.
    n = n + 1.0
    boost = np.minimum((max(step, 1) / n) ** spec.rho, spec.max_lr_multiplier)
    acc = acc + g * g
    update = (boost * g / np.sqrt(acc) + spec.l1_regularization_strength * np.sign(w)
              + spec.l2_regularization_strength * w)
    return w - lr * update, (acc, n)
