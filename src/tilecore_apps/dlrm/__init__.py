"""The main job: a DLRM-style click model trained with tilecore embeddings.

`train(source, config)` tunes the limits (FDO), splits batches over them into
minibatches (`minibatching_plan`), prefetches preprocessed batches in background
threads, runs jitted steps (lookup → dense model → lookup_grad, pipelined across
steps by `tilecore.pipelining`), evaluates held-out loss and AUC, and saves
Orbax checkpoints it can resume from (also when SIGINT or SIGTERM stops it early:
`StopSignals`); `tilecore train` is a thin driver over it.
"""

from ._buffers import MAX_MINIBATCHES as MAX_MINIBATCHES
from ._buffers import minibatched_buffer_size as minibatched_buffer_size
from ._buffers import minibatching_plan as minibatching_plan
from ._checkpoint import Resumed as Resumed
from ._checkpoint import latest_step as latest_step
from ._checkpoint import restore_checkpoint as restore_checkpoint
from ._checkpoint import save_checkpoint as save_checkpoint
from ._config import TrainConfig as TrainConfig
from ._loop import TrainResult as TrainResult
from ._loop import click_features as click_features
from ._loop import input_rate as input_rate
from ._loop import train as train
from ._loop import tuned_plan as tuned_plan
from ._metrics import auc as auc
from ._metrics import log_loss as log_loss
from ._model import ModelConfig as ModelConfig
from ._model import init_params as init_params
from ._model import logits as logits
from ._plots import plot_curves as plot_curves
from ._plots import plot_partition_load as plot_partition_load
from ._prefetch import Prefetcher as Prefetcher
from ._run import NonFiniteLossError as NonFiniteLossError
from ._step import DenseInputs as DenseInputs
from ._step import DeviceBatch as DeviceBatch
from ._step import StepMetrics as StepMetrics
from ._step import click_stages as click_stages
from ._step import make_eval_step as make_eval_step
from ._stop import StopSignals as StopSignals
from ._summary import EvalPoint as EvalPoint
from ._summary import TrainSummary as TrainSummary
from ._workers import HostBatch as HostBatch
from ._workers import InputWorkerError as InputWorkerError
from ._workers import ProcessBatches as ProcessBatches

__all__ = [
    "MAX_MINIBATCHES",
    "DenseInputs",
    "DeviceBatch",
    "EvalPoint",
    "HostBatch",
    "InputWorkerError",
    "ModelConfig",
    "NonFiniteLossError",
    "Prefetcher",
    "ProcessBatches",
    "Resumed",
    "StepMetrics",
    "StopSignals",
    "TrainConfig",
    "TrainResult",
    "TrainSummary",
    "auc",
    "click_features",
    "click_stages",
    "init_params",
    "input_rate",
    "latest_step",
    "log_loss",
    "logits",
    "make_eval_step",
    "minibatched_buffer_size",
    "minibatching_plan",
    "plot_curves",
    "plot_partition_load",
    "restore_checkpoint",
    "save_checkpoint",
    "train",
    "tuned_plan",
]
