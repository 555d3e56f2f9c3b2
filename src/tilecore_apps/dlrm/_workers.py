"""Training batches generated and preprocessed in worker processes (`--input-processes`).

Prefetch threads share the GIL with the main thread's JAX dispatch, so on a
busy host they prepare a batch far slower than an idle core would. Here each
of N worker processes generates its batches (`source.train_batch`) and
preprocesses them (`tilecore.preprocess`, numba); the main process only reads
the results and puts them on the devices.

The workers never import JAX: they are plain `python -P _workers.py` processes
(not `multiprocessing`, whose spawn re-imports the parent's `__main__`, the
JAX-importing CLI), this module imports only the standard library at its top,
and the plan they receive has its tables' JAX initializers removed. Batch
`start + k` goes to worker `k mod N`, so reading the workers in turn returns the
batches in order. Requests and small messages are pickles over the worker's
stdin and stdout (its `print`s go to stderr); the batches' arrays travel in
shared memory (`_slots`: each request lends the worker a free slot, its reply
names where the arrays lie, and the main process reads them in place). A worker
ignores SIGINT and exits when its stdin closes, so Ctrl-C reaches only the main
process, which closes the pipes, waits for the workers, kills any that does not
exit and removes the slots' directory (a worker removes its own slots when it
exits, too, in case the main process was killed).

Each batch also carries the bad rows that the worker's copy of a streamed source
has skipped so far (`HostBatch.bad_rows`); the main process merges them into its
source's count, so a run reports the same count with threads or processes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from types import ModuleType, TracebackType
from typing import IO, TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # the workers import only what they run
    import numpy as np

    from tilecore.data import BadRows, ClickSource
    from tilecore.preprocessing import PreprocessedBatch, PreprocessStats
    from tilecore.stacking import StackingPlan

_EXIT_TIMEOUT_S = 1.0
"""Seconds the workers get to exit after their pipes close: then they are killed (a
batch in the making has nothing worth saving)."""

_MAX_SLOT_BYTES = 1 << 30
"""A batch's arrays over this many bytes travel inside the pickle, not in a slot."""


def _sibling(name: str) -> ModuleType:
    """This package's module `name`, loaded from its file: a worker runs this file as a
    script, outside the package (whose `__init__` imports JAX)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_tilecore_worker{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING or __name__ != "__main__":  # a worker loads it in `_serve` (`_sibling`)
    from . import _slots


def _shm_root() -> str:
    """Where the slots' files go: memory-backed `/dev/shm` if usable, else the temp dir."""
    root = "/dev/shm"
    return root if os.path.isdir(root) and os.access(root, os.W_OK) else tempfile.gettempdir()


class HostBatch(NamedTuple):
    """A training batch prepared by a worker: what the main process puts on the devices.

    `sparse`, `dense` and `labels` are read-only views of the worker's shared-memory
    slot, which goes back to the worker once none of them (nor any view of them,
    nor a device array aliasing them) is referenced any more.
    """

    sparse: PreprocessedBatch
    stats: PreprocessStats
    dense: np.ndarray
    labels: np.ndarray
    seconds: float  # generating and preprocessing it, in the worker
    bad_rows: Mapping[str, BadRows]  # the worker's source's, per file (`StreamedClicks`)


class InputWorkerError(RuntimeError):
    """A worker failed to prepare a batch; the message holds the worker's traceback."""


def host_plan(plan: StackingPlan) -> StackingPlan:
    """`plan` without the tables' initializers (JAX functions preprocessing never calls)."""
    features = {name: dataclasses.replace(f, table=dataclasses.replace(f.table, initializer=None))
                for name, f in plan.features.items()}
    tables = {name: dataclasses.replace(t, initializer=None) for name, t in plan.tables.items()}
    return dataclasses.replace(plan, features=features, tables=tables)


SILENCE_S = 300.0
"""How long a worker may take to return one batch (milliseconds, normally) before it is
taken for stopped or hung and ended with an InputWorkerError."""


class _Worker:
    """One worker process, its two pipes and its shared-memory slots."""

    def __init__(self, index: int, setup: bytes, directory: str) -> None:
        self.index = index
        self.process = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.requests: IO[bytes] = self.process.stdin
        self.results: IO[bytes] = self.process.stdout
        self.slots = _slots.SlotReader(directory)
        self.requests.write(pickle.dumps((directory, index, _MAX_SLOT_BYTES)) + setup)
        self.requests.flush()

    def request(self, step: int) -> None:
        try:
            pickle.dump((step, self.slots.lend()), self.requests)
            self.requests.flush()
        except BrokenPipeError:
            pass  # it died: the read of this step's result reports how

    def result(self, step: int) -> HostBatch:
        silent = threading.Event()

        def stalled() -> None:  # a stopped or hung worker: end it, so that the read ends
            silent.set()
            with contextlib.suppress(OSError):
                self.process.kill()

        timer = threading.Timer(SILENCE_S, stalled)
        timer.daemon = True
        timer.start()
        try:
            kind, payload = pickle.load(self.results)
        except (EOFError, pickle.UnpicklingError, OSError):
            status = self.process.wait()
            if silent.is_set():
                raise InputWorkerError(
                    f"Input worker {self.index} (pid {self.process.pid}) sent nothing for "
                    f"{SILENCE_S:g} s while preparing training batch {step} (stopped or hung), "
                    "and was ended. Rerun without --input-processes to prepare batches in "
                    "threads.") from None
            raise InputWorkerError(
                f"Input worker {self.index} (pid {self.process.pid}) exited with status "
                f"{status} before returning training batch {step} (killed, or out of memory?); "
                "its stderr above may say why. Rerun without --input-processes to prepare "
                "batches in threads.") from None
        finally:
            timer.cancel()
        if kind == "raise":  # the input's fault: the error the threads would raise, caused
            error, text = payload  # by one that holds the worker's traceback
            raise error from InputWorkerError(
                f"Input worker {self.index} failed on training batch {step}: {text}")
        if kind == "error":
            raise InputWorkerError(
                f"Input worker {self.index} failed on training batch {step}: {payload}")
        sent, (stats, seconds, bad_rows) = payload
        sparse, dense, labels = self.slots.read(_slots.Sent(*sent))
        return HostBatch(sparse, stats, dense, labels, seconds, bad_rows)

    def hang_up(self) -> None:
        """Close both pipes: an idle worker exits, a busy one when it next writes."""
        for pipe in (self.requests, self.results):
            with contextlib.suppress(OSError):  # a broken pipe to a dead worker
                pipe.close()

    def reap(self, deadline: float) -> None:
        """Wait for the exit until `deadline` (perf_counter), then kill; never leaves a zombie."""
        try:
            self.process.wait(timeout=max(deadline - time.perf_counter(), 0.0))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ProcessBatches:
    """Training batches `start, start + 1, …` prepared by `processes` worker processes.

    Call `take(step)` with consecutive steps. Up to max(depth, processes)
    batches are in the making at any time. A worker's exception is raised by
    the `take` of its batch: a ValueError (the input's fault: a bad row, a damaged
    file, an exceeded limit) as itself, caused by an `InputWorkerError` with the
    worker's traceback; any other as that `InputWorkerError`.
    A batch's arrays are views of shared memory, reused only once nothing refers
    to them (`HostBatch`). Use as a context manager (or call `close`): it stops
    the workers and removes the shared memory, on errors and early exits too.
    """

    def __init__(self, source: ClickSource, plan: StackingPlan, *, start: int, stop: int,
                 processes: int, depth: int, num_threads: int | None) -> None:
        if processes < 1:
            raise ValueError(f"ProcessBatches: processes must be >= 1, got {processes}.")
        setup = (pickle.dumps(list(sys.path))
                 + pickle.dumps((source, host_plan(plan), num_threads), protocol=5))
        self._start, self._stop = start, stop
        self._ahead = max(depth, processes)
        self._next_request = self._next_take = start
        self._pending: collections.deque[int] = collections.deque()
        self._workers: list[_Worker] = []
        self.slot_directory = tempfile.mkdtemp(prefix=f"tilecore-input-{os.getpid()}-",
                                               dir=_shm_root())
        """The directory of the workers' shared-memory files (removed by `close`)."""
        # If close() is never called: at garbage collection or interpreter exit.
        self._remove = weakref.finalize(self, shutil.rmtree, self.slot_directory, True)
        try:
            for index in range(processes):
                self._workers.append(_Worker(index, setup, self.slot_directory))
            self._fill()
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> tuple[int, ...]:
        """The workers' process IDs (none after `close`)."""
        return tuple(w.process.pid for w in self._workers)

    @property
    def slots(self) -> tuple[tuple[int, int], ...]:
        """Per worker: its slots, and those of them not free (in the making, or viewed by
        arrays still alive)."""
        return tuple((w.slots.slots, w.slots.held) for w in self._workers)

    def _worker(self, step: int) -> _Worker:
        return self._workers[(step - self._start) % len(self._workers)]

    def _fill(self) -> None:
        while self._next_request < self._stop and len(self._pending) < self._ahead:
            self._worker(self._next_request).request(self._next_request)
            self._pending.append(self._next_request)
            self._next_request += 1

    def take(self, step: int) -> HostBatch:
        """Batch `step` (the step after the previous `take`'s, starting at `start`)."""
        if not self._workers:
            raise RuntimeError("ProcessBatches: take() after close().")
        if step != self._next_take or not self._pending:
            raise ValueError(f"ProcessBatches: batches come in order; expected step "
                             f"{self._next_take} (of {self._start}..{self._stop - 1}), got {step}.")
        self._pending.popleft()
        self._next_take += 1
        batch = self._worker(step).result(step)
        self._fill()
        return batch

    def close(self) -> None:
        """Stop the workers (idle ones exit at once, busy ones are killed after 1 s) and
        remove the shared memory's files (arrays still viewing it stay valid)."""
        workers, self._workers = self._workers, []
        try:
            for worker in workers:
                worker.hang_up()
            deadline = time.perf_counter() + _EXIT_TIMEOUT_S
            for worker in workers:
                worker.reap(deadline)
        finally:
            self._remove()

    def __enter__(self) -> ProcessBatches:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _prepare(source: Any, plan: Any, num_threads: int | None, step: int, slot: int,
             writer: Any) -> tuple[Any, Any]:
    """Batch `step`: its arrays written into `slot`, the rest to be pickled with the reply."""
    from tilecore.data import StreamedClicks
    from tilecore.preprocessing import preprocess

    t0 = time.perf_counter()
    batch = source.train_batch(step)
    sparse, stats = preprocess(plan, batch.sparse, num_threads=num_threads)
    seconds = time.perf_counter() - t0
    bad_rows = source.bad_rows_by_file() if isinstance(source, StreamedClicks) else {}
    sent = writer.write(slot, (sparse, batch.dense, batch.labels))
    return tuple(sent), (stats, seconds, bad_rows)  # a plain tuple: the class is the worker's


def _raised_again(error: ValueError, text: str) -> tuple[str, Any]:
    """The message that has the main process raise `error` itself (as the threads of the
    in-process path would; `tilecore train` prints a ValueError as one line), caused by an
    `InputWorkerError` holding `text`, the worker's traceback; if `error` does not survive
    pickling, the `InputWorkerError` alone."""
    try:
        pickle.loads(pickle.dumps(error, protocol=5))
    except Exception:
        return ("error", text)
    return ("raise", (error, text))


def _serve() -> None:
    """The worker's main: answer each (step, slot) read from stdin with its batch."""
    import traceback
    import warnings

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints must not corrupt the result stream
    requests = sys.stdin.buffer
    directory, index, max_bytes = pickle.load(requests)
    sys.path[:] = pickle.load(requests)
    writer = _sibling("_slots").SlotWriter(directory, index, max_bytes=max_bytes)
    setup: tuple[Any, Any, int | None] | None = None
    setup_error = ""
    try:
        from tilecore.data import BadRowsWarning
        from tilecore.preprocessing import IdDroppingWarning

        warnings.simplefilter("ignore", IdDroppingWarning)  # counted from the stats instead
        warnings.simplefilter("ignore", BadRowsWarning)  # merged into the main process's count
        setup = pickle.load(requests)
    except Exception:
        setup_error = f"setting up failed (is the source picklable?):\n{traceback.format_exc()}"
    try:
        while True:
            try:
                step, slot = pickle.load(requests)
            except EOFError:
                return
            if setup is None:
                message: tuple[str, Any] = ("error", setup_error)
            else:
                try:
                    message = ("ok", _prepare(*setup, step, slot, writer))
                except ValueError as error:  # the input's fault (a bad row, a damaged file)
                    message = _raised_again(error, f"\n{traceback.format_exc()}")
                except Exception:
                    message = ("error", f"\n{traceback.format_exc()}")
            try:
                pickle.dump(message, out, protocol=5)
                out.flush()
            except (BrokenPipeError, OSError):
                return  # the main process stopped reading
    finally:
        writer.close()


if __name__ == "__main__":
    _serve()
