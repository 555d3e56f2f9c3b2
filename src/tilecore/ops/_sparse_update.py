"""The one fused sparse-update path: gather touched rows, apply a rule, scatter back
(with the XLA wing's gather and scatter, or a wing's own).

The rule always runs in float32: rows of a half-precision table are upcast when
gathered and written back with stochastic rounding (`_rounding`); slots are float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..optimizers import update_rule
from ..specs import CustomOptimizer, OptimizerSpec
from ..specs._weights_dtype import is_half
from ._rounding import (
    Rounding,
    as_bits,
    from_bits,
    moves_as_bits,
    rounding_bits,
    stochastic_round,
    take_rows,
)
from ._variables import EmbeddingVariables


def _xla_gather(array: jax.Array, rows: jax.Array) -> jax.Array:
    return take_rows(array, rows, mode="clip")


def _xla_scatter(array: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    if moves_as_bits(array.dtype):
        written = as_bits(array).at[rows].set(as_bits(values), mode="drop", unique_indices=True)
        return from_bits(written, array.dtype)
    return array.at[rows].set(values, mode="drop", unique_indices=True)


Gather = Callable[[jax.Array, jax.Array], jax.Array]
Scatter = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def apply_sparse_update(
    variables: EmbeddingVariables,
    rows: jax.Array,
    grads: jax.Array,
    spec: OptimizerSpec,
    step: Any,
    *,
    clip: tuple[float, float] | None = None,
    rounding: Rounding | None = None,
) -> EmbeddingVariables:
    """Apply `spec`'s update rule to the listed rows of a table and its slots.

    Args:
      variables: the table `[V, dim]` and its slots (same shape, `spec.slot_names`
        order).
      rows: `int32[U]` unique row indices into the table. Padding entries hold a
        sentinel `>= V`; their updates are dropped.
      grads: `[U, dim]` gradient of each listed row. A listed row is updated even
        when its gradient is zero (as in the reference); unlisted rows and slots
        stay bit-unchanged.
      spec: the optimizer; `update_rule(spec)` gives the row-wise rule.
      step: the 0-based global step, a Python int or a JAX integer scalar. Pass it
        as a traced argument under `jit` so that one compilation serves every step.
      clip: optional `(min, max)` applied to the updated table rows (never to slots).
      rounding: where a half-precision table's rows take their stochastic-rounding
        bits (required for a bfloat16/float16 table, unused for float32).

    Returns:
      New variables. Under `jax.jit(..., donate_argnums=...)` with `variables`
      donated, XLA updates the table and slots in place.
    """
    return updated(variables, rows, grads, spec, step, clip, _xla_gather, _xla_scatter,
                   rounding)


def updated(variables: EmbeddingVariables, rows: jax.Array, grads: jax.Array,
            spec: OptimizerSpec, step: Any, clip: tuple[float, float] | None,
            gather: Gather, scatter: Scatter, rounding: Rounding | None = None
            ) -> EmbeddingVariables:
    """`apply_sparse_update` with a wing's row gather and scatter (which must drop the
    wing's padding rows)."""
    table, slots = variables.table, tuple(variables.slots)
    if len(slots) != len(spec.slot_names):
        raise ValueError(
            f"{type(spec).__name__} keeps slots {spec.slot_names} but the variables hold "
            f"{len(slots)} slot arrays; build them with tilecore.optimizers.init_slots(spec, "
            "table.shape)."
        )
    if rows.ndim != 1 or grads.shape != (rows.shape[0], *table.shape[1:]):
        raise ValueError(
            f"Expected rows [U] and grads [U, {', '.join(map(str, table.shape[1:]))}]; got "
            f"rows.shape={rows.shape}, grads.shape={grads.shape}, table.shape={table.shape}."
        )
    half = is_half(table.dtype)
    if half and rounding is None:
        raise ValueError(f"A {table.dtype} table is written with stochastic rounding: pass "
                         "rounding= (tilecore.ops.lookup_grad does).")
    rule = update_rule(spec)
    if isinstance(spec, CustomOptimizer):
        check_row_wise(spec, int(table.shape[1]))
    hyperparameters = spec.hyperparameters(step)
    arrays = (table, *slots)
    gathered = [gather(a, rows) for a in arrays]
    if half:  # the rule runs in float32
        gathered[0] = gathered[0].astype(jnp.float32)
    new = rule(grads, *gathered, *hyperparameters)
    if not isinstance(new, tuple | list) or len(new) != len(arrays):
        got = (f"{len(new)} arrays" if isinstance(new, tuple | list)
               else f"a {type(new).__name__}, not a tuple")
        raise ValueError(
            f"The {type(spec).__name__} update rule returned {got}; expected a tuple "
            f"(new_row, *new_slots) of {len(arrays)} array{'s' * (len(arrays) != 1)}."
        )
    for k, (value, before) in enumerate(zip(new, gathered, strict=True)):
        what = "new_row" if k == 0 else f"new slot {k - 1}"
        if jnp.shape(value) != before.shape:  # a broadcast would write garbage in silence
            raise ValueError(
                f"The {type(spec).__name__} update rule returned {what} of shape "
                f"{jnp.shape(value)}; expected {before.shape} (the rows it was given).")
        if not jnp.issubdtype(jnp.result_type(value), jnp.floating):  # cast, it would round
            raise ValueError(
                f"The {type(spec).__name__} update rule returned {what} of dtype "
                f"{jnp.result_type(value)}; expected floating-point rows.")
    new_row, *new_slots = new
    if clip is not None:
        new_row = jnp.clip(new_row, clip[0], clip[1])
    if half:
        assert rounding is not None
        bits = rounding_bits(rounding, rows, table.shape[1])
        new_row = stochastic_round(jnp.asarray(new_row, jnp.float32), table.dtype, bits)
    scattered = [scatter(a, rows, jnp.asarray(v).astype(a.dtype))
                 for a, v in zip(arrays, (new_row, *new_slots), strict=True)]
    return EmbeddingVariables(scattered[0], tuple(scattered[1:]))


_PROBE_ROWS = 3


@functools.cache
def check_row_wise(spec: CustomOptimizer, dim: int) -> None:
    """Raise unless `spec`'s rule is row-wise: each row's result the rule's result for that
    row alone. The rule runs on a block of the touched rows, as many as a batch touches
    and padded as the wing pads; a rule that reduces over the block (`g.sum()`, not
    `g.sum(axis=1)`) made each row depend on the batch's other rows, and on padding
    (the CPU wing's read uninitialised, so one program gave other tables per process).
    Checked once per spec and width on a small block of positive values (a rule that
    cannot run there is left to fail where it runs)."""
    with jax.ensure_compile_time_eval():  # called while tracing: compute, do not stage
        _check_row_wise(spec, dim)


def _check_row_wise(spec: CustomOptimizer, dim: int) -> None:
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.uniform(0.5, 1.5, (_PROBE_ROWS, dim)), jnp.float32)
              for _ in range(2 + len(spec.slot_names))]
    hyperparameters = spec.hyperparameters(0)
    try:
        whole = spec.update_fn(*arrays, *hyperparameters)
        alone = [spec.update_fn(*(a[i:i + 1] for a in arrays), *hyperparameters)
                 for i in range(_PROBE_ROWS)]
        rows = [np.concatenate([np.asarray(part[k], np.float64) for part in alone])
                for k in range(len(whole))]
        mixed = not all(np.allclose(np.asarray(w, np.float64), r, rtol=1e-5, atol=1e-6,
                                    equal_nan=True) for w, r in zip(whole, rows, strict=True))
    except Exception:  # the rule's own errors are raised where it runs
        return
    if mixed:
        raise ValueError(
            f"The CustomOptimizer {spec.name!r} update rule is not row-wise: on a block of "
            f"{_PROBE_ROWS} rows its result for a row differs from its result for that row "
            "alone, so it reduces over rows (e.g. g.sum() or g.mean() over the whole block). "
            "It runs on the rows a batch touches, grouped as each kernel groups them: reduce "
            "along each row only (axis=1, keepdims=True).")
