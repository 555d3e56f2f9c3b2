"""`jax_tpu_embedding.sparsecore.lib.auto_pipelining.auto_pipelining` on tilecore: a
plain train step, pipelined automatically.

Write the step unpipelined — `step(carry, *args) -> (carry, *results)`, with the
embedding variables in the carry, one `tpu_sparse_dense_matmul` and one
`tpu_sparse_dense_matmul_grad` per table (called directly, or by the linen or nnx
`SparseCoreEmbed` and its gradient: an nnx step merges its model from the carry's
`nnx.State` and returns `nnx.state(...)`) — and wrap it:

```
train_step = auto_pipelining(step, out_shardings=None)
state = init_state()
for args in batches:
    state, (carry, *results) = train_step(state, carry, *args)
state, (carry, *results) = finalize_pipelining(train_step, state, carry)
```

Call i (1-based) applies the embedding update of step i−2, looks step i up in the
tables just updated, and runs the dense part of step i−1 (which needs no table, so
on hardware it overlaps the lookup). Hence:

- the results of call i belong to step i−1: call 1's are all None; the results of
  the last step come from `finalize_pipelining`;
- the lookup of step i sees the updates of steps ≤ i−2 (one step stale); the
  dense parameters are never stale;
- the carry after call i has the dense updates of steps ≤ i−1 and the embedding
  updates of steps ≤ i−2; after `finalize_pipelining` it has all of them.

The arguments after the carry are the step's data: they are kept in the state for
one call (the dense part runs a step late). `static_argnums` positions (the carry
is 0) are passed to the step as Python values and kept in the state too; other
arguments must be arrays. The state is a pytree of arrays, changes structure over
the first calls (so the step compiles three times), and its first argument
(`carry`) is donated.

tilecore finds the lookup and update of the step by tracing it with compat's device
functions marked (see `utils`); `decompose` splits the jaxpr. The schedule is
`tilecore.pipelining`'s; the update data (activation gradients, buffers, step)
travels in the state as the reference's does.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Concatenate, Generic, NamedTuple, ParamSpec, TypeVar

import jax
import jax.extend as jex

from ... import _auto_pipelining as _ap
from . import decompose

Carry = decompose.Carry


def dump_jaxpr(jaxpr: jex.core.ClosedJaxpr | jex.core.Jaxpr, name: str) -> None:
    """Write `jaxpr` to `$TEST_UNDECLARED_OUTPUTS_DIR/jaxpr_{name}.txt` if that is set."""
    dirname = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
    if not dirname:
        return
    path = Path(dirname) / f"jaxpr_{name}.txt"
    logging.info("Writing %s Jaxpr to %s", name, path)
    path.write_text(jaxpr.pretty_print(source_info=True))


class EmbeddingPipeliningState(NamedTuple):
    """What is in flight between calls.

    Attributes:
      activations_1: the activations of the previous call's step (its dense part
        runs in the next call), or None.
      args_1: the previous call's arguments after the carry, or None.
      updates_0: the embedding-update data of the step before (activation
        gradients, buffers, step), applied in the next call, or None.
    """

    activations_1: list[jax.Array] | None = None
    args_1: Any = None
    updates_0: list[jax.Array] | None = None


FunctionArgs = ParamSpec("FunctionArgs")
FunctionResults = TypeVar("FunctionResults")


@dataclasses.dataclass
class PipeliningFunction(Generic[FunctionArgs, FunctionResults]):
    """The pipelined train step (`train_step_func`) and its draining call (`finalize`)."""

    train_step_func: Callable[
        Concatenate[EmbeddingPipeliningState, FunctionArgs],
        tuple[EmbeddingPipeliningState, FunctionResults],
    ]
    finalize: Callable[..., Any]

    def __call__(self, state: EmbeddingPipeliningState, *args: FunctionArgs.args,
                 **kwargs: FunctionArgs.kwargs) -> tuple[EmbeddingPipeliningState,
                                                         FunctionResults]:
        return self.train_step_func(state, *args, **kwargs)


def init_state() -> EmbeddingPipeliningState:
    """The state before the first call: nothing in flight."""
    return EmbeddingPipeliningState()


def _run(runner: decompose.FunctionRunner, dense_runner: decompose.FunctionRunner,
         state: EmbeddingPipeliningState, carry: Carry, args_2: Any) -> tuple[Any, Any]:
    """One call: update (step i−2), lookup (step i), dense (step i−1), in flight shifted."""
    activations_2 = None
    if args_2 is not None and state.updates_0 is not None:
        activations_2, carry = runner.embedding_update_lookup(state.updates_0, carry, *args_2)
    elif args_2 is not None:
        activations_2 = runner.embedding_lookup(carry, *args_2)
    elif state.updates_0 is not None:
        carry = runner.embedding_update(state.updates_0, carry)
    if state.args_1 is not None and state.activations_1 is not None:
        updates_1, carry, *results = dense_runner.dense(state.activations_1, carry,
                                                        *state.args_1)
    else:
        updates_1 = None
        _, *results = runner.none_result()
    next_state = EmbeddingPipeliningState(
        activations_1=activations_2,
        args_1=args_2 if args_2 is not None else state.args_1,  # kept for tracing finalize
        updates_0=updates_1,
    )
    return next_state, (carry, *results)


def finalize_pipelining(fn: Callable[..., Any], state: EmbeddingPipeliningState,
                        carry: Carry) -> tuple[EmbeddingPipeliningState, tuple[Any, ...]]:
    """Drain the pipeline: the last step's dense part, then the last two updates.

    Returns the final state and `(carry, *results)` with the last step's results and
    every embedding update applied.
    """
    if not isinstance(fn, PipeliningFunction):
        raise TypeError(f"finalize_pipelining: {_ap.name_of(fn)} is not wrapped by "
                        "auto_pipelining; pass the function auto_pipelining returned.")
    if (isinstance(state, EmbeddingPipeliningState) and state.args_1 is not None
            and state.activations_1 is None and state.updates_0 is None):
        raise ValueError("finalize_pipelining: the pipeline is drained "
                         "already (this state is a finalize's); nothing is in flight.")
    state, (carry, *results) = fn.finalize(state, carry)
    state, (carry, *_) = fn.finalize(state, carry)
    return state, (carry, *results)


def auto_pipelining(
    fn: Callable[FunctionArgs, FunctionResults],
    out_shardings: tuple[Any, ...] | None,
    static_argnums: tuple[int, ...] = (),
) -> PipeliningFunction[FunctionArgs, FunctionResults]:
    """Pipeline the train step `fn(carry, *args) -> (carry, *results)` (see the module).

    Args:
      fn: the plain step; its carry (argument and first result, same structure)
        holds the embedding variables.
      out_shardings: `jax.jit`'s out_shardings for `(state, (carry, *results))`
        (None: chosen by XLA).
      static_argnums: positions of `fn`'s static arguments (≥ 1; the carry is 0).

    Returns:
      A `PipeliningFunction`: `(state, carry, *args) -> (state, (carry, *results))`.
    """
    static = _ap.check_static_argnums(fn, static_argnums)

    def build(carry: Carry, args: Any) -> decompose.FunctionRunner:
        runner = _ap.build_runner(fn, static, carry, args)
        for part in ("lookup", "dense", "update", "update_lookup"):
            dump_jaxpr(getattr(runner, f"{part}_jaxpr"), part)
        return runner

    def train_pipeline(state: EmbeddingPipeliningState, carry: Carry, *args: Any) -> Any:
        args_2 = _ap.wrap_statics(args, static)
        runner = build(carry, args_2)
        same = state.args_1 is None or _ap.same_signature(state.args_1, args_2)
        return _run(runner, runner if same else build(carry, state.args_1), state, carry,
                    args_2)

    def finalize_pipeline(state: EmbeddingPipeliningState, carry: Carry) -> Any:
        runner = build(carry, state.args_1)
        return _run(runner, runner, state, carry, None)

    jit_step = jax.jit(train_pipeline, out_shardings=out_shardings,
                       static_argnums=tuple(n + 1 for n in static), donate_argnames=("carry",))
    jit_finalize = jax.jit(finalize_pipeline, out_shardings=out_shardings,
                           donate_argnames=("carry",))

    @functools.wraps(fn)
    def call(state: EmbeddingPipeliningState, carry: Carry, *args: Any, **kwargs: Any) -> Any:
        _check_state(fn, state)
        _ap.check_call(fn, static, carry, args, kwargs)
        return jit_step(state, carry, *args)

    def finalize(state: EmbeddingPipeliningState, carry: Carry) -> Any:
        _check_state(fn, state)
        if state.args_1 is None:
            raise ValueError(f"finalize_pipelining({_ap.name_of(fn)}): no step has run; call "
                             "the pipelined step at least once before finalizing.")
        return jit_finalize(state, carry)

    return PipeliningFunction(call, finalize)  # pyright: ignore[reportArgumentType]


def _check_state(fn: Callable[..., Any], state: Any) -> None:
    if not isinstance(state, EmbeddingPipeliningState):
        raise TypeError(f"auto_pipelining({_ap.name_of(fn)}): the first argument must be the "
                        "EmbeddingPipeliningState from init_state() or the previous call; got "
                        f"{type(state).__name__}.")
