"""Background preparation of the next batches while the device computes the current one.

Host preprocessing (numba kernels and numpy, which release the GIL) runs in
worker threads while the main thread dispatches jitted steps (asynchronous), so
the two overlap: the host stays ahead of the device by up to `depth` batches.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Generic, TypeVar

from ._profile import annotate

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """Iterate over `produce(0), …, produce(count − 1)`, computed up to `depth` ahead.

    Results come back in index order whatever order the workers finish in. An
    exception raised by `produce(i)` is raised by the `next()` that would have
    returned item i, after the prefetcher has shut down (pending work
    cancelled). `depth=0` computes each item in the caller's thread, on demand.
    Use as a context manager (or call `close`) so the workers stop on early exit.
    """

    def __init__(self, produce: Callable[[int], T], count: int, *, depth: int = 2,
                 workers: int | None = None) -> None:
        if depth < 0 or count < 0:
            raise ValueError(f"Prefetcher: depth and count must be >= 0, got {depth=}, {count=}.")
        workers = depth if workers is None else workers
        if depth and workers < 1:
            raise ValueError(f"Prefetcher: workers must be >= 1 with depth {depth}, got {workers}.")
        self._produce, self._count, self._depth = produce, count, depth
        self._next_submit = self._next_yield = 0
        self._pending: collections.deque[Future[T]] = collections.deque()
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="tilecore-prefetch")
                      if depth else None)
        self._closed = False
        self._fill()

    def _fill(self) -> None:
        while (self._pool is not None and not self._closed and self._next_submit < self._count
               and len(self._pending) < self._depth):
            self._pending.append(self._pool.submit(self._produce, self._next_submit))
            self._next_submit += 1

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._closed or self._next_yield >= self._count:
            self.close()
            raise StopIteration
        index = self._next_yield
        self._next_yield += 1
        try:
            if self._pool is None:
                return self._produce(index)
            future = self._pending.popleft()
            with annotate("wait_for_batch"):
                result = future.result()
        except BaseException:
            self.close()
            raise
        self._fill()
        return result

    def close(self) -> None:
        """Cancel what has not started, wait for what has, and stop the workers."""
        if self._closed:
            return
        self._closed = True
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
