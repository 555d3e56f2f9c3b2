"""The training loop: tune limits, prefetch batches, step, evaluate, checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from collections.abc import Mapping
from typing import TextIO

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from tilecore import ops
from tilecore.data import ClickSource, StreamedClicks, click_feature_specs
from tilecore.fdo import TuneReport, tune_limits
from tilecore.pipelining import DenseState, StepInput, TrainState, TrainStep, train_state_sharding
from tilecore.preprocessing import IdDroppingWarning
from tilecore.specs import FeatureSpec
from tilecore.stacking import StackingPlan, plan_stacking

from ._buffers import minibatching_plan
from ._checkpoint import Resumed, latest_step, restore_checkpoint, save_checkpoint
from ._config import TrainConfig
from ._input import Inputs, measure_input_rate
from ._model import init_params
from ._profile import annotate, maybe_trace
from ._progress import Progress
from ._run import Hooks, LoopStats, evaluate_all, run_steps
from ._step import click_stages, make_eval_step
from ._stop import StopSignals
from ._summary import LoadTracker, TrainSummary
from ._tables import init_variables, uniform_init


def click_features(source: ClickSource, config: TrainConfig) -> list[FeatureSpec]:
    """A feature per click feature, on the tables they name (`tilecore.data.click_feature_specs`:
    a table each unless shared; `sum` pools one-hot features, `mean` multi-hot ones)."""
    return list(click_feature_specs(
        source.features, source.batch_size, embedding_dim=config.model.embedding_dim,
        optimizer=config.table_optimizer, initializer=uniform_init))


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


def tuned_plan(source: ClickSource, config: TrainConfig) -> tuple[StackingPlan, TuneReport]:
    """The click model's plan with limits tuned by FDO on `config.tune_batches` training
    batches, prepared for training as `config` says (minibatching or dropping)."""
    plan = plan_stacking(click_features(source, config), config.topology)
    with annotate("fdo"):
        tune_set = [source.train_batch(i).sparse for i in range(config.tune_batches)]
        plan, report = tune_limits(plan, tune_set, headroom=config.tune_headroom,
                                   num_threads=config.num_threads)
    # Limits are tuned without minibatching (it would split the tune batches instead);
    # dropping stays allowed as the last resort (a row alone over a limit cannot be split).
    plan = plan.with_config(allow_id_dropping=True)
    return (minibatching_plan(plan) if config.minibatching else plan), report


def _place(state: TrainState, mesh: Mesh | None) -> TrainState:
    """`state` on the mesh (tables by rows, the rest replicated); as is without one."""
    return state if mesh is None else jax.device_put(state, train_state_sharding(state, mesh))


def train(source: ClickSource, config: TrainConfig, *, progress: TextIO | None = None
          ) -> TrainResult:
    """Train the click model on `source` as `config` says; returns summary and final state.

    Limits are tuned first on `config.tune_batches` training batches (FDO); later
    batches whose IDs exceed them are split into minibatches (`config.minibatching`,
    counted per step in the summary) or else drop the excess (counted). With
    `config.resume` and a checkpoint in `config.checkpoint_dir`, training goes on
    from its step with its tables, slots, dense parameters and optimizer state
    (the summary then covers the steps run now). The progress bar goes to
    `progress` (default stderr). While the steps run (in the main thread), SIGINT or
    SIGTERM stops training after the steps in flight, with an evaluation and a
    checkpoint there (`StopSignals`; the summary's `stopped_by` says so); a second
    SIGINT interrupts at once.

    Raises:
      NonFiniteLossError: the loss became NaN or Inf; names the step (and the
        tables, if their activations are not finite). No checkpoint is written.
      tilecore.checkpoint.CheckpointMismatchError: the checkpoint resumed from
        has other tables than the model; lists every difference.
      ValueError: the checkpoint directory already holds checkpoints but
        `resume` is off, or the resumed checkpoint is at or past `config.steps`.
    """
    t_start = time.perf_counter()
    mesh = _mesh(config)
    resume_from = _resume_step(config)
    # The warnings filter also silences the prefetch threads: they join before it ends.
    with warnings.catch_warnings(), contextlib.ExitStack() as cleanup:
        warnings.simplefilter("ignore", IdDroppingWarning)
        plan, report = tuned_plan(source, config)
        inputs = Inputs(source, config, plan, mesh)
        feed = inputs.open(cleanup, start=resume_from or 0, stop=config.steps)
        eval_set = [(inputs.to_device(b)[0], b.labels) for b in
                    (source.eval_batch(i) for i in range(config.eval_batches))]
        optimizer = optax.adam(config.dense_learning_rate)
        step = TrainStep(stages=click_stages(plan, optimizer, mesh=mesh),
                         pipelined=config.pipelining)
        params = init_params(jax.random.key(config.seed), config.model,
                             num_dense=source.num_dense, num_features=len(plan.features))
        start = _initial(config, plan, DenseState.create(params, optimizer), mesh, resume_from)
        # On the host: `step.init` puts the example's leaves (num_minibatches among them) in
        # several places of the state, which must not share one device buffer (donation).
        example = jax.tree.map(np.asarray, StepInput(eval_set[0][0].sparse, eval_set[0][0].dense))
        state = _place(step.init(start.variables, start.dense, example), mesh)
        evaluate = make_eval_step(plan, mesh=mesh)
        directory = config.checkpoint_dir
        stop = cleanup.enter_context(StopSignals())
        hooks = Hooks(
            feed=feed,
            evaluate=lambda s: evaluate_all(evaluate, s, eval_set),
            restart=lambda s: _place(step.init(s.variables, s.dense, example), mesh),
            save=None if directory is None else functools.partial(save_checkpoint, directory, plan),
            stop_requested=stop.requested,
        )
        setup_s = time.perf_counter() - t_start
        bar = Progress(config.steps, source.batch_size, stream=progress)
        load = LoadTracker(plan)
        with maybe_trace(config.profile_dir):
            state, stats = run_steps(
                step, state, hooks, plan=plan, start=start.step, steps=config.steps,
                eval_every=config.eval_every, checkpoint_every=config.checkpoint_every,
                bar=bar, load=load)
    summary = _summary(source, config, plan, report, stats, load, start.step,
                       setup_seconds=setup_s, seconds=time.perf_counter() - t_start,
                       stopped_by=None if stop.signal is None else stop.signal.name)
    return TrainResult(summary=summary, state=state, plan=plan)


def _summary(source: ClickSource, config: TrainConfig, plan: StackingPlan, report: TuneReport,
             stats: LoopStats, load: LoadTracker, start_step: int, *, setup_seconds: float,
             seconds: float, stopped_by: str | None = None) -> TrainSummary:
    """What a run did, from its steps' statistics (`run_steps`), the partition load and the
    FDO report; throughput from the timed steps (the first, which compiles, left out)."""
    steps = config.steps if stats.stopped_at is None else stats.stopped_at
    run_steps_count = steps - start_step
    timed = stats.timed_seconds
    return TrainSummary(
        steps=steps, batch_size=source.batch_size,
        stopped_by=None if stats.stopped_at is None else stopped_by or "end of data",
        requested_steps=None if stats.stopped_at is None else config.steps,
        examples_per_s=((run_steps_count - 1) * source.batch_size / timed
                        if run_steps_count > 1 and timed > 0 else float("nan")),
        loss=stats.evals[-1].loss, auc=stats.evals[-1].auc, dropped_ids=load.dropped_ids,
        minibatching=config.minibatching, num_minibatches=max(stats.minibatches, default=1),
        minibatched_steps=sum(m > 1 for m in stats.minibatches),
        mean_minibatches=(float(np.mean(stats.minibatches)) if stats.minibatches else 1.0),
        train_losses=tuple(stats.train_losses),
        evals=tuple(stats.evals), compile_seconds=stats.compile_seconds,
        eval_seconds=stats.eval_seconds, topology=str(config.topology),
        devices=config.topology.global_devices, sc_per_device=config.topology.sc_per_device,
        optimizer=type(config.table_optimizer).__name__, pipelining=config.pipelining,
        limits=_limits(plan), partition_load=load.result(), setup_seconds=setup_seconds,
        fdo_rounds=report.rounds, fdo_drops_per_round=report.drops_per_round,
        seconds=seconds, start_step=start_step,
        checkpoint=stats.checkpoint,
        checkpoint_seconds=stats.checkpoint_seconds,
        input_wait_seconds=stats.input_wait_seconds,
        input_wait_fraction=(stats.input_wait_seconds / timed if timed > 0 else float("nan")),
        preprocess_seconds_per_batch=stats.preprocess_seconds / max(run_steps_count, 1),
        step_seconds=(timed / (run_steps_count - 1) if run_steps_count > 1 else float("nan")),
        input=(f"{config.staged_batches} staged" if config.staged_batches else
               f"{config.input_processes} processes" if config.input_processes else "threads"),
        bad_rows=source.bad_rows if isinstance(source, StreamedClicks) else 0,
    )


def input_rate(source: ClickSource, config: TrainConfig, *, batches: int = 100) -> float:
    """Examples/s the host alone delivers with `config`'s input pipeline (threads or
    worker processes): `batches` training batches generated, preprocessed and put on
    the devices, no step run. Above a run's `examples_per_s` with staged batches
    (`TrainConfig.staged_batches`), the host can keep the devices busy."""
    if batches < 1:
        raise ValueError(f"input_rate: batches must be >= 1, got {batches}.")
    if config.staged_batches:
        raise ValueError("input_rate measures preparing batches; the config stages them "
                         f"(staged_batches={config.staged_batches}): set it to 0.")
    mesh = _mesh(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IdDroppingWarning)
        plan, _ = tuned_plan(source, config)
        return measure_input_rate(Inputs(source, config, plan, mesh), batches=batches)


def _resume_step(config: TrainConfig) -> int | None:
    """The step to resume from (None: start fresh), checked before any work is done."""
    directory = config.checkpoint_dir
    saved = None if directory is None else latest_step(directory)
    if saved is None:
        return None
    if not config.resume:
        raise ValueError(
            f"{str(directory)!r} already holds checkpoints (latest: step {saved}); a fresh run "
            "would mix with them. Resume from it (TrainConfig.resume / `tilecore train "
            "--resume`), or write to another directory (--out).")
    if saved >= config.steps:
        raise ValueError(
            f"The checkpoint in {str(directory)!r} is at step {saved}, but the run has only "
            f"{config.steps} steps: nothing is left to train. Ask for more steps "
            "(TrainConfig.steps is the step to stop at, counted from 0, not the steps to add).")
    return saved


def _initial(config: TrainConfig, plan: StackingPlan, dense: DenseState, mesh: Mesh | None,
             resume_from: int | None) -> Resumed:
    """The starting point: the checkpoint's state if resuming, else fresh tables; on the
    CPU, on huge pages (`ops.use_huge_pages`: the steps update them in place)."""
    if resume_from is not None and config.checkpoint_dir is not None:
        with annotate("restore"):
            resumed = restore_checkpoint(config.checkpoint_dir, plan, dense, mesh=mesh)
    else:
        resumed = Resumed(0, init_variables(plan, config.seed, mesh=mesh), dense)
    ops.use_huge_pages(resumed.variables)
    return resumed


def _limits(plan: StackingPlan) -> dict[str, Mapping[str, int | None]]:
    return {name: {"max_ids_per_partition": s.max_ids_per_partition,
                   "max_unique_ids_per_partition": s.max_unique_ids_per_partition,
                   "suggested_coo_buffer_size_per_device": s.suggested_coo_buffer_size_per_device}
            for name, s in plan.stacks.items()}
