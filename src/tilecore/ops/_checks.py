"""Opt-in runtime checks and the memory-bounded ordering of stacks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ..specs import QuantizationConfig

T = TypeVar("T")


def _raise_if_not_finite(finite: np.ndarray, *, stack: str, what: str) -> None:
    if not bool(finite):
        raise FloatingPointError(
            f"Stack {stack!r}: {what} contain NaN or Inf. Check the inputs' weights, the "
            "learning rate and the loss; lower the learning rate or clip the tables."
        )


def check_finite(xs: jax.Array | Sequence[jax.Array], *, stack: str, what: str) -> None:
    """Raise (through the runtime) if an array of `xs` holds NaN or Inf, naming the stack
    (one host round trip for them all)."""
    arrays = [xs] if isinstance(xs, jax.Array) else list(xs)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in arrays]))
    jax.debug.callback(_raise_if_not_finite, finite, stack=stack, what=what)


def quantize(rows: jax.Array, config: QuantizationConfig) -> jax.Array:
    """Simulated quantization: clip to [min, max] and round to `num_buckets` levels."""
    step = (config.max_value - config.min_value) / (config.num_buckets - 1)
    clipped = jnp.clip(rows, config.min_value, config.max_value)
    return jnp.round((clipped - config.min_value) / step) * step + config.min_value


def one_after_another(work: Sequence[tuple[Callable[[Any], T], Any]]) -> list[T]:
    """`[fn(inputs) for fn, inputs in work]`, each starting after the previous finished.

    XLA may otherwise schedule every stack's update at once, keeping all their
    temporaries alive together. Passing the previous result and the next inputs
    through one optimization barrier makes the next wait (the role of
    `xla_sc_num_serialized_tables_to_optimize_hbm`).
    """
    results: list[T] = []
    for fn, inputs in work:
        if results:
            results[-1], inputs = jax.lax.optimization_barrier((results[-1], inputs))
        results.append(fn(inputs))
    return results
