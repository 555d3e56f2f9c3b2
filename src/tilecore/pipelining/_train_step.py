"""`TrainStep`: the jitted step function, pipelined or plain behind one flag."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from ._state import TrainState
from ._step import initial_state, pipelined_step, plain_step
from ._types import Stages, StepInput, StepOutput, Variables


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStep:
    """A jitted training step over `stages`, pipelined or not.

    `step(state, inputs, fake_tc_step=...)` runs `pipelined_step` or `plain_step`
    compiled once per value of the static `fake_tc_step` (a pipelined loop needs
    two programs, a plain loop one). With `donate` the state's buffers are
    reused for the new state, so tables are updated in place: do not use a state
    after passing it in.

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
        return initial_state(self.stages, variables, dense_state, example,
                             pipelined=self.pipelined)

    @functools.cached_property
    def jitted(self) -> Callable[..., tuple[TrainState, StepOutput]]:
        """The compiled step function `(state, inputs, *, fake_tc_step)` (for inspection)."""
        step = pipelined_step if self.pipelined else plain_step
        return jax.jit(functools.partial(step, self.stages), static_argnames="fake_tc_step",
                       donate_argnums=0 if self.donate else ())

    def __call__(self, state: TrainState, inputs: StepInput, *, fake_tc_step: bool = False
                 ) -> tuple[TrainState, StepOutput]:
        if (state.pipeline is not None) != self.pipelined:
            kind = "pipelined" if self.pipelined else "plain"
            raise ValueError(f"A {kind} TrainStep got a state built for the other kind; "
                             f"build it with this step's init().")
        return self.jitted(state, inputs, fake_tc_step=fake_tc_step)
