"""What `train` does: one frozen value with every knob of the main job."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tilecore.ops import PreprocessOn
from tilecore.specs import Adagrad, OptimizerSpec, Topology

from ._model import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings of a training run (the defaults are those of `tilecore train`).

    Attributes:
      steps: the global step to train up to (one batch per step): a run resumed from
        a checkpoint at step k trains steps k + 1 … `steps` (`tilecore train --steps`
        counts the steps to add instead).
      model: sizes of the dense model and the embedding width.
      table_optimizer: the tilecore optimizer of every table.
      dense_learning_rate: Adam's learning rate for the dense parameters.
      topology: devices × logical SparseCores per device.
      eval_every: evaluate on the held-out batches every this many steps (and at
        the end).
      eval_batches: held-out batches per evaluation.
      prefetch: batches prepared ahead by background workers (0: none).
      input_processes: generate and preprocess the training batches in this many
        worker processes, which do not share the main process's GIL (0: in
        prefetch threads). Batches in the making: max(prefetch, input_processes).
        The source must be picklable (the built-in ones are).
      staged_batches: train on this many batches prepared and put on the devices
        before the loop, cycled (0: a fresh batch every step). The host then
        prepares nothing during the loop, so examples/s is what the devices (and
        the step's dispatch) sustain: compare with a normal run to tell whether
        the input pipeline limits training (`tilecore bench train`).
      tune_batches: training batches the limits are tuned on (FDO) before training.
      tune_headroom: tuned limits grow by this fraction (later batches may need more:
        they are split into minibatches, or without `minibatching` the IDs over
        the limits are dropped and counted).
      minibatching: split batches over the tuned limits into minibatches
        (`SparseCoreConfig.enable_minibatching`) so no ID is dropped; the COO
        buffers are sized for up to 8 minibatches (`minibatching_plan`).
      pipelining: overlap SparseCore and TensorCore stages of consecutive steps
        (when `tilecore.pipelining` is available).
      num_threads: preprocessing threads per batch (None: tilecore's default).
      preprocess_on: where batches are packed (`tilecore.ops.preprocess_batch`):
        "host", "device" (the same bits; needs `minibatching=False` and no
        `input_processes`, which are host-side), or "auto": the side measured
        faster, today the host (`tilecore.ops.PreprocessOn`).
      seed: seed of the model's initial values.
      profile_dir: write a `jax.profiler` trace of the training loop here.
      checkpoint_dir: save the state here (tilecore.checkpoint, the newest 2
        steps kept) at the end of training (None: no checkpoints).
      checkpoint_every: also save after every this many steps (None: only at
        the end). Each save ends a pipelined segment (the pipeline drains).
      resume: continue from the newest checkpoint in `checkpoint_dir` if there
        is one (its tables, slots, dense parameters, optimizer state and step).
    """

    steps: int = 1000
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    table_optimizer: OptimizerSpec = dataclasses.field(
        default_factory=lambda: Adagrad(learning_rate=0.3))
    dense_learning_rate: float = 1e-2
    topology: Topology = dataclasses.field(
        default_factory=lambda: Topology(global_devices=1, sc_per_device=4))
    eval_every: int = 200
    eval_batches: int = 4
    prefetch: int = 2
    input_processes: int = 0
    staged_batches: int = 0
    tune_batches: int = 4
    tune_headroom: float = 0.1
    minibatching: bool = True
    pipelining: bool = True
    num_threads: int | None = None
    preprocess_on: PreprocessOn = "auto"
    seed: int = 0
    profile_dir: Path | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "eval_every", "eval_batches", "tune_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig: {name} must be an integer >= 1, got {value!r}.")
        every = self.checkpoint_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise ValueError(f"TrainConfig: checkpoint_every must be None or an integer >= 1, "
                             f"got {every!r}.")
        for name in ("prefetch", "input_processes", "staged_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainConfig: {name} must be an integer >= 0, got {value!r}.")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"TrainConfig: num_threads must be >= 1, got {self.num_threads!r}.")
        if not self.dense_learning_rate > 0 or not self.tune_headroom >= 0:
            raise ValueError(
                f"TrainConfig: need dense_learning_rate > 0 and tune_headroom >= 0, got "
                f"{self.dense_learning_rate!r} and {self.tune_headroom!r}.")
        if self.preprocess_on not in ("host", "device", "auto"):
            raise ValueError(f"TrainConfig: preprocess_on must be 'host', 'device' or 'auto', "
                             f"got {self.preprocess_on!r}.")
        if self.preprocess_on == "device" and (self.minibatching or self.input_processes):
            raise ValueError(
                "TrainConfig: preprocess_on='device' packs batches in the main process without "
                "minibatching; set minibatching=False and input_processes=0 (--no-minibatching, "
                "--input-processes 0), or preprocess on the host.")
        if self.staged_batches and self.input_processes:
            raise ValueError("TrainConfig: staged_batches and input_processes exclude each other "
                             "(staged batches are prepared once, before the loop).")
