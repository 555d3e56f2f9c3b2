"""The final summary of a run: numbers for people (text) and for machines (JSON)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from tilecore.preprocessing import PreprocessStats
from tilecore.stacking import StackingPlan


@dataclasses.dataclass(frozen=True)
class EvalPoint:
    """Held-out loss and AUC after `step` training steps."""

    step: int
    loss: float
    auc: float


class LoadTracker:
    """Per-partition load of every stack over the run, and the IDs dropped.

    Load is each step's `max_ids_per_partition` statistic (max over local
    devices): the plots show its maximum and mean over steps next to the limit.
    """

    def __init__(self, plan: StackingPlan) -> None:
        self.plan = plan
        self.steps = 0
        self.dropped_ids = 0
        n = plan.num_partitions
        self._max = {name: np.zeros(n, np.int64) for name in plan.stacks}
        self._sum = {name: np.zeros(n, np.int64) for name in plan.stacks}

    def add(self, stats: PreprocessStats) -> None:
        self.steps += 1
        self.dropped_ids += stats.dropped_ids
        for name in self.plan.stacks:
            load = np.max(stats.max_ids_per_partition[name], axis=0)
            np.maximum(self._max[name], load, out=self._max[name])
            self._sum[name] += load

    def result(self) -> dict[str, dict[str, Any]]:
        steps = max(self.steps, 1)
        return {name: {"max": self._max[name].tolist(),
                       "mean": (self._sum[name] / steps).round(2).tolist(),
                       "limit": self.plan.stacks[name].max_ids_per_partition}
                for name in self.plan.stacks}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSummary:
    """Everything a run reports. `loss` and `auc` are the last held-out evaluation's;
    `examples_per_s` excludes the first (compiling) step, evaluations and saves.

    A resumed run (`start_step` > 0) reports the steps it ran, `start_step` to
    `steps`. Host vs device: `step_seconds` is the wall time per step in steady
    state, `preprocess_seconds_per_batch` what preparing one batch took a
    prefetch worker, and `input_wait_fraction` the share of the steady-state
    loop spent waiting for the next prepared batch (near 0: the host keeps up).
    `input` says how batches were prepared: prefetch "threads", "N processes"
    (`input_processes`) or "N staged" (`staged_batches`: cycled, nothing prepared
    during the loop).

    Minibatching: `num_minibatches` is the most minibatches any step was split
    into (1: none was), `minibatched_steps` how many steps were split and
    `mean_minibatches` the mean per step; `dropped_ids` counts the IDs dropped
    over the run (0 with minibatching, unless one row alone exceeds a limit or a
    batch needs more than its buffer holds).

    `bad_rows`: rows of streamed data files skipped as unreadable
    (`ReadOptions.skip_bad_rows`), each counted once, whether batches were read
    in threads or in worker processes.

    `stopped_by`: the signal ("SIGINT", "SIGTERM") that stopped the run at `steps`,
    before the steps it was asked for (`requested_steps`); None for a run that
    finished.
    """

    steps: int
    batch_size: int
    examples_per_s: float
    loss: float
    auc: float
    dropped_ids: int
    num_minibatches: int
    minibatched_steps: int
    mean_minibatches: float
    minibatching: bool
    train_losses: tuple[float, ...]
    evals: tuple[EvalPoint, ...]
    compile_seconds: float
    eval_seconds: float
    topology: str
    devices: int
    sc_per_device: int
    optimizer: str
    pipelining: bool
    limits: Mapping[str, Mapping[str, int | None]]
    partition_load: Mapping[str, Mapping[str, Any]]
    setup_seconds: float = 0.0
    seconds: float = 0.0
    fdo_rounds: int = 0
    fdo_drops_per_round: tuple[int, ...] = ()
    pipelining_note: str = ""
    checkpoint: str | None = None
    start_step: int = 0
    checkpoint_seconds: float = 0.0
    input_wait_seconds: float = 0.0
    input_wait_fraction: float = float("nan")
    preprocess_seconds_per_batch: float = float("nan")
    step_seconds: float = float("nan")
    input: str = "threads"  # where batches came from: "threads", "N processes", "N staged"
    bad_rows: int = 0
    stopped_by: str | None = None
    requested_steps: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; the headline keys come first."""
        out = dataclasses.asdict(self)
        out["evals"] = [dataclasses.asdict(e) for e in self.evals]
        head = ("examples_per_s", "auc", "loss", "dropped_ids", "num_minibatches",
                "minibatched_steps", "mean_minibatches")
        return {**{k: out.pop(k) for k in head}, **out}

    def format(self) -> str:
        """The summary as a few lines of text."""
        first = self.evals[0] if self.evals else None
        ran = (f"steps {self.start_step + 1}-{self.steps} (resumed from step {self.start_step})"
               if self.start_step else f"{self.steps} steps")
        lines = [
            f"trained {ran} x {self.batch_size} examples on {self.topology} "
            f"(devices x SparseCores), tables: {self.optimizer}, pipelining: "
            f"{'on' if self.pipelining else 'off'}"
            + (f" ({self.pipelining_note})" if self.pipelining_note else "")
            + (f"; stopped by {self.stopped_by} before step {self.requested_steps}"
               if self.stopped_by is not None else ""),
            f"  throughput    {self.examples_per_s:,.0f} examples/s (after compiling "
            f"{self.compile_seconds:.1f} s; eval {self.eval_seconds:.1f} s; total "
            f"{self.seconds:.1f} s)",
            f"  held-out      loss {self.loss:.4f}  AUC {self.auc:.4f}"
            + (f"  (after step {first.step}: loss {first.loss:.4f}, AUC {first.auc:.4f})"
               if first is not None and len(self.evals) > 1 else ""),
            f"  host          input: {self.input}; waits for batches "
            f"{100 * self.input_wait_fraction:.1f}% of the loop; {1e3 * self.preprocess_seconds_per_batch:.1f} ms to prepare a batch vs "
            f"{1e3 * self.step_seconds:.1f} ms per step",
            f"  IDs dropped   {self.dropped_ids}   FDO rounds {self.fdo_rounds} (drops "
            f"{list(self.fdo_drops_per_round)})",
            *([f"  bad rows      {self.bad_rows} skipped (unreadable rows of the data)"]
              if self.bad_rows else []),
            "  minibatching  " + (
                f"on: {self.minibatched_steps} of {self.steps - self.start_step} steps split, "
                f"at most {self.num_minibatches} minibatch"
                f"{'' if self.num_minibatches == 1 else 'es'} per step (mean "
                f"{self.mean_minibatches:.3f})" if self.minibatching else
                "off: IDs over the limits are dropped"),
            "  limits        " + "; ".join(
                f"{name}: ids {v['max_ids_per_partition']}, unique "
                f"{v['max_unique_ids_per_partition']}, coo "
                f"{v['suggested_coo_buffer_size_per_device']}"
                for name, v in self.limits.items()),
        ]
        return "\n".join(lines)
