"""Where the training loop's batches come from, and how fast the host alone makes them.

Three ways, chosen by `TrainConfig`:
- prefetch threads (the default): generate, preprocess and put batch i on the
  devices in a background thread while the device runs earlier steps;
- worker processes (`input_processes`): JAX-free processes generate and
  preprocess, one background thread reads their results in order (from shared
  memory, no copy) and puts them on the devices, so the main thread only
  dispatches steps;
- staged batches (`staged_batches`): a few batches are put on the devices
  before the loop and cycled, so the host prepares nothing while it runs. Its
  examples/s is the devices' ceiling; `input_rate` is the host's. Comparing the
  three says which side limits training (`tilecore bench train`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tilecore import ops
from tilecore.data import ClickBatch, ClickSource, StreamedClicks
from tilecore.preprocessing import PreprocessedBatch, PreprocessStats
from tilecore.stacking import StackingPlan

from ._config import TrainConfig
from ._prefetch import Prefetcher
from ._profile import annotate
from ._step import DenseInputs, DeviceBatch
from ._workers import ProcessBatches

Prepared = tuple[DeviceBatch, PreprocessStats, int, float]  # batch, stats, minibatches, seconds


@dataclasses.dataclass(frozen=True)
class Feed:
    """How the loop gets training batch `step`: `batch(step)`, run up to `depth`
    batches ahead by `threads` prefetch threads (None: `depth` of them; depth 0: in
    the loop's thread)."""

    batch: Callable[[int], Prepared]
    depth: int
    threads: int | None = None


class Inputs:
    """The run's input pipeline: preprocessing and placement on the devices (or mesh)."""

    def __init__(self, source: ClickSource, config: TrainConfig, plan: StackingPlan,
                 mesh: Mesh | None) -> None:
        self.source, self.config, self.plan = source, config, plan
        # Input workers preprocess on the host, in their own processes.
        self.preprocess_on: ops.PreprocessOn = (
            "host" if config.input_processes
            else ops.resolve_preprocess_on(config.preprocess_on, plan))
        self.shardings = None if mesh is None else (
            NamedSharding(mesh, PartitionSpec(ops.DEFAULT_AXIS)), NamedSharding(mesh, PartitionSpec()))

    def to_device(self, batch: ClickBatch) -> tuple[DeviceBatch, PreprocessStats, int]:
        """Preprocess and transfer; also the statistics and the number of minibatches."""
        with annotate("preprocess"):
            sparse, stats = ops.preprocess_batch(self.plan, batch.sparse,
                                                 preprocess_on=self.preprocess_on,
                                                 num_threads=self.config.num_threads)
        return self.put(sparse, batch.dense, batch.labels), stats, sparse.num_minibatches

    def put(self, sparse: PreprocessedBatch, dense: np.ndarray, labels: np.ndarray
            ) -> DeviceBatch:
        """A preprocessed batch on the devices (split by rows over the mesh, if any)."""
        with annotate("transfer"):
            host = DeviceBatch(sparse, DenseInputs(dense, labels))
            if self.shardings is None:
                return jax.device_put(host)
            by_batch, replicated = self.shardings  # arrays split by their leading (batch) axis
            placement = jax.tree.map(lambda x: by_batch if np.ndim(x) else replicated, host)
            return jax.device_put(host, placement)

    def train_batch(self, step: int) -> Prepared:
        """Training batch `step` on the devices, its statistics and the seconds it took."""
        t0 = time.perf_counter()
        batch, stats, num_minibatches = self.to_device(self.source.train_batch(step))
        return batch, stats, num_minibatches, time.perf_counter() - t0

    def _worker_batch(self, batches: ProcessBatches, step: int) -> Prepared:
        """Training batch `step` from the input workers, on the devices (the seconds are
        the worker's, generating and preprocessing, plus the transfer's).

        The worker's arrays are views of its shared-memory slot, put on the devices as
        they are: on CPU the device arrays may alias the slot, elsewhere the transfer
        may still read it after `put` returns. Neither needs a copy or a wait here:
        the slot goes back to the worker only once no array refers to it (`_slots`).
        """
        host = batches.take(step)
        if host.bad_rows and isinstance(self.source, StreamedClicks):
            self.source.merge_bad_rows(host.bad_rows)  # the worker's count joins the run's
        t0 = time.perf_counter()
        batch = self.put(host.sparse, host.dense, host.labels)
        return batch, host.stats, host.sparse.num_minibatches, host.seconds + time.perf_counter() - t0

    def open(self, cleanup: contextlib.ExitStack, *, start: int, stop: int) -> Feed:
        """The feed of training batches `start … stop − 1` (worker processes, if any, are
        started now, so they import while the steps compile, and stop with `cleanup`)."""
        config = self.config
        if config.staged_batches:
            staged = [self.train_batch(start + i) for i in range(config.staged_batches)]
            return Feed(lambda step: staged[(step - start) % len(staged)], depth=0)
        if config.input_processes:
            batches = cleanup.enter_context(ProcessBatches(
                self.source, self.plan, start=start, stop=stop,
                processes=config.input_processes, depth=config.prefetch,
                num_threads=config.num_threads))
            # One thread takes the workers' batches in order and puts them on the devices.
            return Feed(functools.partial(self._worker_batch, batches), depth=config.prefetch,
                        threads=1)
        return Feed(self.train_batch, depth=config.prefetch)


def measure_input_rate(inputs: Inputs, *, batches: int) -> float:
    """Examples/s the host alone delivers: `batches` training batches prepared by
    `inputs`' pipeline (as in training) and put on the devices, with no step run."""
    with contextlib.ExitStack() as cleanup:
        feed = inputs.open(cleanup, start=0, stop=batches + 1)
        with Prefetcher(feed.batch, batches + 1, depth=feed.depth,
                        workers=feed.threads) as prepared:
            jax.block_until_ready(next(prepared)[0])  # start-up (workers importing) not timed
            t0 = time.perf_counter()
            for batch, *_ in prepared:
                jax.block_until_ready(batch)
            seconds = time.perf_counter() - t0
    return batches * inputs.source.batch_size / seconds
