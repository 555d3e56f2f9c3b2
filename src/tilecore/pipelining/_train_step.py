"""`TrainStep`: the jitted step function, pipelined or plain behind one flag."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

from ..distributed._together import note_step
from ._sharding import mesh_shardings
from ._state import TrainState, is_deleted
from ._step import initial_state, pipelined_step, plain_step
from ._types import Stages, StepInput, StepOutput, Variables, check_input


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStep:
    """A jitted training step over `stages`, pipelined or not.

    `step(state, inputs, fake_tc_step=...)` runs `pipelined_step` or `plain_step`
    compiled once per value of the static `fake_tc_step` (a pipelined loop needs
    two programs, a plain loop one). The new state is placed exactly like the
    state passed in (its arrays on a mesh keep their `NamedSharding`, e.g. from
    `train_state_sharding`), so every later call finds the same input placement
    and reuses those programs. With `donate` the state's buffers are reused for
    the new state, so tables are updated in place: do not use a state after
    passing it in, even when the step raises (an error then says so).

    Attributes:
      stages: the stage functions (`sparsecore_stages`).
      pipelined: overlap the SC work of step i with the TC work of step i−1
        (one step of table staleness) instead of running them in sequence.
      donate: donate the state to the step.
    """

    stages: Stages
    pipelined: bool = True
    donate: bool = True

    def init(self, variables: Variables, dense_state: Any, example: StepInput) -> TrainState:
        """The state before the first call (see `initial_state`)."""
        check_input(example)
        return initial_state(self.stages, variables, dense_state, example,
                             pipelined=self.pipelined)

    @functools.cached_property
    def jitted(self) -> Callable[..., tuple[TrainState, StepOutput]]:
        """The compiled step function `(state, inputs, *, fake_tc_step)` (for inspection).

        Its output placement is left to the compiler; calling the `TrainStep`
        pins it to the input state's (see `jitted_for`).
        """
        return self._jit(None)

    def jitted_for(self, state: TrainState) -> Callable[..., tuple[TrainState, StepOutput]]:
        """The compiled step function that returns its state placed like `state`.

        One function per placement (the same one for every state of a loop, as
        each call's output is placed like its input); `jitted` when no array of
        `state` is on a mesh.
        """
        # Called every step: the key is built from the leaves' shardings directly (cheaper
        # than `mesh_shardings`, which runs only when a new placement is seen).
        leaves, treedef = jax.tree.flatten(state)
        key = (treedef, tuple(getattr(x, "sharding", None) for x in leaves))
        fn = self._pinned.get(key)
        if fn is None:
            on_mesh = any(isinstance(s, NamedSharding) for s in key[1])
            fn = self._pinned[key] = self._jit(mesh_shardings(state)) if on_mesh else self.jitted
        return fn

    @functools.cached_property
    def _pinned(self) -> dict[Any, Callable[..., tuple[TrainState, StepOutput]]]:
        return {}

    def _jit(self, state_shardings: Any) -> Callable[..., tuple[TrainState, StepOutput]]:
        step = pipelined_step if self.pipelined else plain_step

        def run(state: TrainState, inputs: StepInput, *, fake_tc_step: bool
                ) -> tuple[TrainState, StepOutput]:
            new, out = step(self.stages, state, inputs, fake_tc_step=fake_tc_step)
            if (before := jax.tree.structure(state)) != (after := jax.tree.structure(new)):
                raise ValueError(
                    "The step returned a state of another structure than it was given, so "
                    f"every call would compile anew: given {before}, returned {after}. "
                    "Make the TC stage return its dense state (and the SC backward stage "
                    "its variables) in the structure it receives them.")
            return new, out

        return jax.jit(run, static_argnames="fake_tc_step",
                       donate_argnums=0 if self.donate else (),
                       out_shardings=None if state_shardings is None else (state_shardings,
                                                                           None))

    def __call__(self, state: TrainState, inputs: StepInput, *, fake_tc_step: bool = False
                 ) -> tuple[TrainState, StepOutput]:
        if (state.pipeline is not None) != self.pipelined:
            kind = "pipelined" if self.pipelined else "plain"
            raise ValueError(f"A {kind} TrainStep got a state built for the other kind; "
                             f"build it with this step's init().")
        check_input(inputs)
        note_step()  # a peer that ran fewer steps ends this process, not a hang
        step = self.jitted_for(state)
        try:
            return step(state, inputs, fake_tc_step=fake_tc_step)
        except Exception as error:
            if self.donate and is_deleted(state):
                error.add_note(
                    "tilecore: this TrainStep donates its state (donate=True) and the failed "
                    "step had taken it, so the state passed in is gone (its arrays are "
                    "deleted). Restore the last checkpoint to go on; TrainStep(donate=False) "
                    "keeps the state a failing step was given, at the cost of a copy of the "
                    "tables per step.")
            raise
