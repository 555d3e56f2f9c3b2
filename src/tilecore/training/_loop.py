"""The training loop: tune limits, prefetch batches, step, evaluate, checkpoint."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import ops
from ..data import ClickBatch, ClickSource
from ..fdo import tune_limits
from ..pipelining import (
    DenseState,
    StepInput,
    TrainState,
    TrainStep,
    run_loop,
    train_state_sharding,
)
from ..preprocessing import IdDroppingWarning, PreprocessStats, preprocess
from ..specs import FeatureSpec, TableSpec
from ..stacking import StackingPlan, plan_stacking
from ._checkpoint import save_checkpoint
from ._config import TrainConfig
from ._metrics import auc, log_loss
from ._model import init_params
from ._prefetch import Prefetcher
from ._profile import annotate, maybe_trace
from ._progress import Progress
from ._step import DenseInputs, DeviceBatch, StepMetrics, click_stages, make_eval_step
from ._summary import EvalPoint, LoadTracker, TrainSummary
from ._tables import init_variables, uniform_init


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or Inf loss; the message names the step and the tables."""


def click_features(source: ClickSource, config: TrainConfig) -> list[FeatureSpec]:
    """One table per click feature: `sum` for one-hot, `mean` for multi-hot features."""
    return [
        FeatureSpec(
            name=f.name, input_shape=(source.batch_size, f.max_ids),
            table=TableSpec(name=f.name, vocab_size=f.vocab_size,
                            embedding_dim=config.model.embedding_dim,
                            optimizer=config.table_optimizer, initializer=uniform_init,
                            combiner="sum" if f.max_ids == 1 else "mean"),
        )
        for f in source.features
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What `train` returns: the summary, the final state and the plan it ran with."""

    summary: TrainSummary
    state: TrainState
    plan: StackingPlan


def _mesh(config: TrainConfig) -> Mesh | None:
    devices = config.topology.global_devices
    if jax.device_count() < devices:
        raise ValueError(
            f"The topology {config.topology} needs {devices} devices but JAX has "
            f"{jax.device_count()}. On CPU start with XLA_FLAGS="
            f"--xla_force_host_platform_device_count={devices} (`tilecore train --devices` "
            "does this)."
        )
    if devices == 1:
        return None
    # Auto axes: XLA shards the dense model's gradients (batch-split contractions) itself.
    return jax.make_mesh((devices,), (ops.DEFAULT_AXIS,), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))


class _Runner:
    """Per-run pieces shared by the loop's stages (plan, mesh, placement, preprocessing)."""

    def __init__(self, source: ClickSource, config: TrainConfig, plan: StackingPlan,
                 mesh: Mesh | None) -> None:
        self.source, self.config, self.plan, self.mesh = source, config, plan, mesh
        self.shardings = None if mesh is None else (
            NamedSharding(mesh, PartitionSpec(ops.DEFAULT_AXIS)), NamedSharding(mesh, PartitionSpec()))

    def to_device(self, batch: ClickBatch) -> tuple[DeviceBatch, PreprocessStats, int]:
        """Preprocess and transfer; also the statistics and the number of minibatches."""
        with annotate("preprocess"):
            sparse, stats = preprocess(self.plan, batch.sparse, num_threads=self.config.num_threads)
        with annotate("transfer"):
            host = DeviceBatch(sparse, DenseInputs(batch.dense, batch.labels))
            if self.shardings is None:
                return jax.device_put(host), stats, sparse.num_minibatches
            by_batch, replicated = self.shardings  # arrays split by their leading (batch) axis
            placement = jax.tree.map(lambda x: by_batch if np.ndim(x) else replicated, host)
            return jax.device_put(host, placement), stats, sparse.num_minibatches

    def train_batch(self, step: int) -> tuple[DeviceBatch, PreprocessStats, int]:
        return self.to_device(self.source.train_batch(step))


def _check_finite(step: int, metrics: StepMetrics, plan: StackingPlan) -> float:
    loss = float(metrics.loss)
    if math.isfinite(loss):
        return loss
    bad = sorted({plan.features[f].table.name for f, ok in metrics.finite.items() if not bool(ok)})
    where = (f"the activations of table(s) {bad} are NaN or Inf (the table rows diverged: "
             "lower the table learning rate)" if bad else
             "every table's activations are finite, so the dense model or its inputs diverged "
             "(check the dense features, lower the dense learning rate)")
    raise NonFiniteLossError(f"Training stopped at step {step}: the loss is {loss}; {where}.")


def _evaluate(evaluate: Any, state: TrainState,
              eval_set: list[tuple[DeviceBatch, np.ndarray]]) -> tuple[float, float]:
    with annotate("eval"):
        logits = [np.asarray(evaluate(state.dense.params, state.variables, b))
                  for b, _ in eval_set]
    labels = np.concatenate([y for _, y in eval_set])
    scores = np.concatenate(logits)
    if not np.all(np.isfinite(scores)):
        raise NonFiniteLossError("Evaluation produced NaN or Inf logits; the model diverged.")
    return log_loss(labels, scores), auc(labels, scores)


def train(source: ClickSource, config: TrainConfig, *, progress: TextIO | None = None
          ) -> TrainResult:
    """Train the click model on `source` as `config` says; returns summary and final state.

    Limits are tuned first on `config.tune_batches` training batches (FDO); later
    batches whose IDs exceed them drop the excess (counted in the summary). The
    progress bar goes to `progress` (default stderr). Raises `NonFiniteLossError`
    naming the step (and the tables, if their activations are not finite) when
    the loss becomes NaN or Inf; no checkpoint is written then.
    """
    t_start = time.perf_counter()
    mesh = _mesh(config)
    plan = plan_stacking(click_features(source, config), config.topology)
    with warnings.catch_warnings():  # also silences the prefetch workers: they join before exit
        warnings.simplefilter("ignore", IdDroppingWarning)
        with annotate("fdo"):
            tune_set = [source.train_batch(i).sparse for i in range(config.tune_batches)]
            plan, report = tune_limits(plan, tune_set, headroom=config.tune_headroom,
                                       num_threads=config.num_threads)
        plan = plan.with_config(allow_id_dropping=True)
        runner = _Runner(source, config, plan, mesh)
        eval_set = [(runner.to_device(b)[0], b.labels) for b in
                    (source.eval_batch(i) for i in range(config.eval_batches))]
        optimizer = optax.adam(config.dense_learning_rate)
        step = TrainStep(stages=click_stages(plan, optimizer, mesh=mesh),
                         pipelined=config.pipelining)
        params = init_params(jax.random.key(config.seed), config.model,
                             num_dense=source.num_dense, num_features=len(plan.features))
        state = step.init(init_variables(plan, config.seed, mesh=mesh),
                          DenseState.create(params, optimizer),
                          StepInput(eval_set[0][0].sparse, eval_set[0][0].dense))
        if mesh is not None:
            state = jax.device_put(state, train_state_sharding(state, mesh))
        setup_s = time.perf_counter() - t_start
        with maybe_trace(config.profile_dir):
            state, summary = _run(runner, step, state, make_eval_step(plan, mesh=mesh),
                                  eval_set, progress)
    summary = dataclasses.replace(summary, setup_seconds=setup_s, fdo_rounds=report.rounds,
                                  fdo_drops_per_round=report.drops_per_round,
                                  seconds=time.perf_counter() - t_start)
    if config.checkpoint_dir is not None:
        with annotate("checkpoint"):
            path = save_checkpoint(config.checkpoint_dir, plan, state, step=config.steps)
        summary = dataclasses.replace(summary, checkpoint=str(path),
                                      seconds=time.perf_counter() - t_start)
    return TrainResult(summary=summary, state=state, plan=plan)


def _run(runner: _Runner, step: TrainStep, state: TrainState, evaluate: Any,
         eval_set: list[tuple[DeviceBatch, np.ndarray]], progress: TextIO | None
         ) -> tuple[TrainState, TrainSummary]:
    config, plan, steps = runner.config, runner.plan, runner.config.steps
    bar = Progress(steps, runner.source.batch_size, stream=progress)
    losses: list[float] = []
    evals: list[EvalPoint] = []
    load = LoadTracker(plan)
    eval_s, compile_s, minibatches = 0.0, 0.0, 0
    pending: tuple[int, StepMetrics] | None = None
    t_loop = time.perf_counter()

    def inputs(batches: Prefetcher[tuple[DeviceBatch, PreprocessStats, int]]
               ) -> Iterator[StepInput]:
        nonlocal minibatches
        for batch, stats, num_minibatches in batches:
            load.add(stats)
            minibatches += num_minibatches
            yield StepInput(batch.sparse, batch.dense)

    with Prefetcher(runner.train_batch, steps, depth=config.prefetch) as batches:
        run = run_loop(step, state, inputs(batches))
        for result in run:
            i = result.step
            metrics = StepMetrics(*result.outputs[:1], finite=result.outputs[1])
            if i == 0:  # the first calls compile: keep them out of examples/s
                losses.append(_check_finite(0, metrics, plan))
                compile_s = time.perf_counter() - t_loop
                bar.start(1)
            elif pending is not None:  # the previous step's loss: the device stays busy
                losses.append(_check_finite(*pending, plan))
            pending = None if i == 0 else (i, metrics)
            done = i + 1
            if done % config.eval_every == 0 or done == steps:
                if pending is not None:
                    losses.append(_check_finite(*pending, plan))
                    pending = None
                t_eval = time.perf_counter()
                loss, score = _evaluate(evaluate, run.state, eval_set)
                evals.append(EvalPoint(step=done, loss=loss, auc=score))
                eval_s += time.perf_counter() - t_eval
                bar.exclude(time.perf_counter() - t_eval)
                bar.message(f"eval after step {done}: loss {loss:.4f}  AUC {score:.4f}")
            bar.update(done, losses[-1] if losses else None)
        state = run.state
    bar.close()
    timed = time.perf_counter() - t_loop - compile_s - eval_s
    summary = TrainSummary(
        steps=steps, batch_size=runner.source.batch_size,
        examples_per_s=((steps - 1) * runner.source.batch_size / timed
                        if steps > 1 and timed > 0 else float("nan")),
        loss=evals[-1].loss, auc=evals[-1].auc, dropped_ids=load.dropped_ids,
        num_minibatches=minibatches, train_losses=tuple(losses), evals=tuple(evals),
        compile_seconds=compile_s, eval_seconds=eval_s, topology=str(config.topology),
        devices=config.topology.global_devices, sc_per_device=config.topology.sc_per_device,
        optimizer=type(config.table_optimizer).__name__, pipelining=config.pipelining,
        limits=_limits(plan), partition_load=load.result(),
    )
    return state, summary


def _limits(plan: StackingPlan) -> dict[str, Mapping[str, int | None]]:
    return {name: {"max_ids_per_partition": s.max_ids_per_partition,
                   "max_unique_ids_per_partition": s.max_unique_ids_per_partition,
                   "suggested_coo_buffer_size_per_device": s.suggested_coo_buffer_size_per_device}
            for name, s in plan.stacks.items()}
