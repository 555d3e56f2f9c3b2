"""The training loop driver: fill, steady state and drain, with outputs in step order."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, NamedTuple

from ._sharding import place_like
from ._state import TrainState, is_deleted, placeholder_input
from ._train_step import TrainStep
from ._types import StepInput


class StepResult(NamedTuple):
    """The outputs of real step `step` (0-based, in the order of the batches)."""

    step: int
    outputs: Any


class TrainingRun(Iterator[StepResult]):
    """Iterating runs the loop; `state` is the latest state (the final one at the end).

    A pipelined run makes `pipeline_steps(n)` calls for n batches: call 0 fills
    the pipeline (SC forward of step 0 only), call k ≤ n yields the outputs of
    step k−1, call n+1 drains it (SC backward of the last step). The drain
    inputs are an empty batch and zero dense inputs shaped like the first batch
    (and placed like it, so the drain reuses the programs of the other calls).
    The last result is yielded after the drain call, so when the loop ends every
    table update has been applied. A plain run makes one call per batch.

    A pipelined run left early (a `break`) holds the SparseCore update of the last
    step it yielded back: `finish()` applies it. A run whose batches, or whose step,
    raise finishes itself before the error goes on (when the step's donated state is
    still there). Either way `state` then holds every update of the steps yielded, and
    the batch the pipeline had read ahead is not trained.

    With a donating `TrainStep`, `state` is only valid until the next iteration.
    """

    def __init__(self, step: TrainStep, state: TrainState, batches: Iterable[StepInput]):
        self.state = state
        self._unfinished: Callable[[], None] | None = None
        self._results = self._pipelined(step, batches) if step.pipelined else self._plain(
            step, batches)

    def __next__(self) -> StepResult:
        return next(self._results)

    def finish(self) -> TrainState:
        """End the run where it stands and return `state`, every update of the steps
        yielded so far applied (a pipelined run's held-back SparseCore update; nothing to
        do for a plain run or one that ended). Iterating afterwards yields nothing."""
        self._results.close()
        self._complete()
        return self.state

    def _complete(self) -> None:
        unfinished, self._unfinished = self._unfinished, None
        if unfinished is not None:
            unfinished()

    def _plain(self, step: TrainStep, batches: Iterable[StepInput]
               ) -> Generator[StepResult, None, None]:
        for index, inputs in enumerate(batches):
            self.state, out = step(self.state, inputs)
            yield StepResult(index, out.outputs)

    def _pipelined(self, step: TrainStep, batches: Iterable[StepInput]
                   ) -> Generator[StepResult, None, None]:
        batches = iter(batches)
        first = next(batches, None)
        if first is None:
            return
        dummy = place_like(placeholder_input(first), first)

        def drain_last() -> None:  # the SC backward of the last yielded step
            self.state, _ = step(self.state, dummy, fake_tc_step=True)

        self.state, _ = step(self.state, first, fake_tc_step=True)
        self._unfinished = drain_last
        last = 0
        try:
            for last, inputs in enumerate(batches, start=1):
                self.state, out = step(self.state, inputs)
                yield StepResult(last - 1, out.outputs)
        except Exception as error:
            if not is_deleted(self.state):
                try:
                    self._complete()
                except Exception as also:
                    error.add_note(f"tilecore: finishing the run's last step failed too: {also!r}")
            raise
        self._unfinished = None
        self.state, out = step(self.state, dummy)
        drain_last()
        yield StepResult(last, out.outputs)


def run_loop(step: TrainStep, state: TrainState, batches: Iterable[StepInput]) -> TrainingRun:
    """Train over `batches`, yielding each real step's outputs in order.

    ```
    step = TrainStep(stages=sparsecore_stages(plan, optax_tc(loss, opt)), pipelined=True)
    run = run_loop(step, step.init(variables, dense, first_batch), batches)
    for result in run:
        log(result.step, result.outputs)
    variables = run.state.variables  # every update applied
    ```

    Switching `pipelined` off changes nothing else. Batches are consumed lazily,
    one call ahead of the outputs when pipelined.
    """
    return TrainingRun(step, state, batches)
