"""The step loop: prefetched batches through pipelined steps, evaluations, checkpoints.

Training runs in segments that end at the checkpoint steps. Each segment is one
`run_loop` (a pipelined one fills and drains its pipeline), so every checkpoint
holds a consistent state with all updates applied, and a run resumed from step
k replays the same segments as one that never stopped. The host's wait for the
next preprocessed batch is timed: `input_wait_fraction` in the summary says
whether the host keeps up with the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tilecore.pipelining import StepInput, TrainState, TrainStep, run_loop
from tilecore.stacking import StackingPlan

from ._input import Feed, Prepared
from ._metrics import auc, log_loss
from ._prefetch import Prefetcher
from ._profile import annotate
from ._progress import Progress
from ._step import DeviceBatch, StepMetrics
from ._summary import EvalPoint, LoadTracker


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or Inf loss; the message names the step and the tables."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hooks:
    """What the loop calls back into: batches, evaluation, restarts and saves.

    Attributes:
      feed: global step → the prepared batch (run ahead by the prefetch threads).
      evaluate: state → held-out (loss, AUC).
      restart: a drained state → the state that starts the next segment.
      save: (state, step=global step) → the checkpoint's path; called at every
        checkpoint step (None: no checkpoints).
      stop_requested: whether to stop early (`StopSignals.requested`): the loop takes
        no more batches, finishes the steps in flight, evaluates and saves there.
    """

    feed: Feed
    evaluate: Callable[[TrainState], tuple[float, float]]
    restart: Callable[[TrainState], TrainState]
    save: Callable[..., Path] | None
    stop_requested: Callable[[], bool] = lambda: False


@dataclasses.dataclass(kw_only=True)
class LoopStats:
    """What the loop measured (all times in seconds)."""

    train_losses: list[float] = dataclasses.field(default_factory=list)
    evals: list[EvalPoint] = dataclasses.field(default_factory=list)
    compile_seconds: float = 0.0
    eval_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    timed_seconds: float = float("nan")
    input_wait_seconds: float = 0.0
    preprocess_seconds: float = 0.0
    minibatches: list[int] = dataclasses.field(default_factory=list)  # per step
    checkpoint: str | None = None
    stopped_at: int | None = None  # the global step reached when a stop was requested


def segment_ends(start: int, steps: int, every: int | None) -> list[int]:
    """The global steps after which a segment ends: multiples of `every`, and `steps`."""
    ends = [] if every is None else list(range((start // every + 1) * every, steps, every))
    return [*ends, steps]


def check_finite(step: int, metrics: StepMetrics, plan: StackingPlan) -> float:
    """The step's loss as a float; raises `NonFiniteLossError` naming the bad tables."""
    loss = float(metrics.loss)
    if math.isfinite(loss):
        return loss
    bad = sorted({plan.features[f].table.name for f, ok in metrics.finite.items() if not bool(ok)})
    where = (f"the activations of table(s) {bad} are NaN or Inf (the table rows diverged: "
             "lower the table learning rate)" if bad else
             "every table's activations are finite, so the dense model or its inputs diverged "
             "(check the dense features, lower the dense learning rate)")
    raise NonFiniteLossError(f"Training stopped at step {step}: the loss is {loss}; {where}.")


def run_steps(step: TrainStep, state: TrainState, hooks: Hooks, *, plan: StackingPlan,
              start: int, steps: int, eval_every: int, checkpoint_every: int | None,
              bar: Progress, load: LoadTracker) -> tuple[TrainState, LoopStats]:
    """Train global steps `start … steps − 1` from `state`; returns the final state."""
    stats = LoopStats()
    pending: tuple[int, StepMetrics] | None = None
    t_loop = time.perf_counter()

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            stats.train_losses.append(check_finite(*pending, plan))
            pending = None

    feed = hooks.feed
    with Prefetcher(lambda i: feed.batch(start + i), steps - start, depth=feed.depth,
                    workers=feed.threads) as batches:
        step_inputs = _step_inputs(batches, hooks, stats, load)
        begin = done = start
        for end in segment_ends(start, steps, checkpoint_every):
            if begin != start:
                state = hooks.restart(state)
            run = run_loop(step, state, itertools.islice(step_inputs, end - begin))
            for result in run:
                i = begin + result.step
                metrics = StepMetrics(*result.outputs[:1], finite=result.outputs[1])
                if i == start:  # the first calls compile: keep them out of examples/s
                    stats.train_losses.append(check_finite(i, metrics, plan))
                    stats.compile_seconds = time.perf_counter() - t_loop
                    bar.start(start + 1)
                else:  # the previous step's loss: reading it now keeps the device busy
                    flush()
                    pending = (i, metrics)
                done = i + 1
                if done % eval_every == 0 or done == steps:
                    flush()
                    _evaluate(hooks, run.state, done, stats, bar)
                bar.update(done, stats.train_losses[-1] if stats.train_losses else None)
            state = run.state
            flush()
            if done < end:  # a stop was requested: the steps in flight have finished
                _stop_at(hooks, state, done, saved=done == begin, stats=stats, bar=bar)
                break
            begin = end
            if hooks.save is not None:
                _save(hooks.save, state, end, stats, bar)
    bar.close()
    stats.timed_seconds = (time.perf_counter() - t_loop - stats.compile_seconds
                           - stats.eval_seconds - stats.checkpoint_seconds)
    return state, stats


def _step_inputs(batches: Prefetcher[Prepared], hooks: Hooks, stats: LoopStats,
                 load: LoadTracker) -> Iterator[StepInput]:
    """The prefetched batches as the loop's inputs, until they end or a stop is requested;
    the time spent waiting for each (after the first: start-up), its preprocessing time,
    minibatches and load recorded in `stats` and `load`."""
    while not hooks.stop_requested():
        t_wait = time.perf_counter()
        item = next(batches, None)
        if item is None:
            return
        if stats.compile_seconds:  # the first batch's wait is start-up, not steady state
            stats.input_wait_seconds += time.perf_counter() - t_wait
        batch, prep_stats, num_minibatches, seconds = item
        load.add(prep_stats)
        stats.minibatches.append(num_minibatches)
        stats.preprocess_seconds += seconds
        yield StepInput(batch.sparse, batch.dense)


def _stop_at(hooks: Hooks, state: TrainState, done: int, *, saved: bool, stats: LoopStats,
             bar: Progress) -> None:
    """End a run stopped after global step `done`: evaluate there (unless the last
    evaluation was) and save there (unless `saved`: the segment ran no step)."""
    stats.stopped_at = done
    if not stats.evals or stats.evals[-1].step != done:
        _evaluate(hooks, state, done, stats, bar)
    if hooks.save is not None and not saved:
        _save(hooks.save, state, done, stats, bar)


def _evaluate(hooks: Hooks, state: TrainState, done: int, stats: LoopStats,
              bar: Progress) -> None:
    """Evaluate after step `done`: the point into `stats`, its time out of the bar's rate."""
    t_eval = time.perf_counter()
    with annotate("eval"):
        loss, score = hooks.evaluate(state)
    stats.evals.append(EvalPoint(step=done, loss=loss, auc=score))
    stats.eval_seconds += time.perf_counter() - t_eval
    bar.exclude(time.perf_counter() - t_eval)
    bar.message(f"eval after step {done}: loss {loss:.4f}  AUC {score:.4f}")


def _save(save: Callable[..., Path], state: TrainState, end: int, stats: LoopStats,
          bar: Progress) -> None:
    """Checkpoint at step `end`: the path into `stats`, its time out of the bar's rate."""
    t_save = time.perf_counter()
    with annotate("checkpoint"):
        stats.checkpoint = str(save(state, step=end))
    stats.checkpoint_seconds += time.perf_counter() - t_save
    bar.exclude(time.perf_counter() - t_save)


def evaluate_all(evaluate: Any, state: TrainState,
                 eval_set: list[tuple[DeviceBatch, np.ndarray]]) -> tuple[float, float]:
    """Held-out log loss and AUC of `state` over `eval_set`."""
    logits = [np.asarray(evaluate(state.dense.params, state.variables, b)) for b, _ in eval_set]
    labels = np.concatenate([y for _, y in eval_set])
    scores = np.concatenate(logits)
    if not np.all(np.isfinite(scores)):
        raise NonFiniteLossError("Evaluation produced NaN or Inf logits; the model diverged.")
    return log_loss(labels, scores), auc(labels, scores)
