"""Processes of one job agree before they start, and fail together when one fails.

Two failure modes of multi-process jobs end badly without this:

- processes whose plans differ (limits, learning rates, topology) run their
  collectives with buffers of different sizes: gloo aborts the process
  (`op.preamble.length <= op.nbytes`) with no Python exception;
- a process that raises leaves its peers waiting in a collective forever, and
  never exits itself (JAX's shutdown barrier waits for the peers).

`agree_on_plan` compares a fingerprint of the plan (every table with its optimizer
and hyperparameters, feature, stack, limit, the topology and config) and any
further hyperparameters the caller names, through JAX's distributed key-value
store, and raises the same `ValueError` on every process on a mismatch. The
device ops call it (through `ensure_agreed`) the first time they trace a plan in
a multi-process job. `fail_together` makes a process that dies of an uncaught
exception publish its error and exit at once, and makes every peer that sees
the error exit non-zero within a few seconds, naming the failed process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from types import TracebackType
from typing import Any, NoReturn

from ..stacking import StackingPlan
from ._agreement import DistributedAgreement
from ._exchange import KeyValueStore, jax_store
from ._fingerprint import canonical, digest, plan_items

FAILED_KEY = "tilecore/failed/"
"""`<FAILED_KEY><process>` holds the error a process died of."""
EXIT_CODE = 71
"""What a process exits with when a peer failed (the failed one exits with 1)."""

_agreed: set[str] = set()
_lock = threading.Lock()
_installed = threading.Event()
_stopping = threading.Event()


def agree_on_plan(plan: StackingPlan, *, hyperparameters: Mapping[str, Any] | None = None,
                  timeout_s: float = 300.0) -> None:
    """Check that every process holds this plan (and these `hyperparameters`).

    Call it on every process at the same point (after `jax.distributed.initialize`).
    Raises `ValueError` on every process, naming the processes and items that
    differ; `TimeoutError` naming the processes that did not arrive in `timeout_s`.
    With one process it returns at once.
    """
    store, me, count = _runtime()
    if store is None or count == 1:
        return
    items = plan_items(plan)
    if hyperparameters is not None:
        items["hyperparameters"] = canonical(dict(hyperparameters))
    agreement = DistributedAgreement(None, timeout_s=timeout_s, name="startup", store=store,
                                     process_id=me, process_count=count)
    agreement.check_items(items, "plans and hyperparameters")


def ensure_agreed(plan: StackingPlan) -> None:
    """`agree_on_plan` once per distinct plan of this process (the ops call it while
    tracing), with `fail_together` installed first."""
    store, _, count = _runtime()
    if store is None or count == 1:
        return
    fail_together()
    key = digest(plan_items(plan))
    with _lock:
        if key in _agreed:
            return
    agree_on_plan(plan)
    with _lock:
        _agreed.add(key)


def fail_together(*, poll_s: float = 1.0) -> None:
    """Make this process's uncaught exception end every process of the job.

    Installs (once) a `sys.excepthook` that publishes the error under
    `tilecore/failed/<process>`, prints the traceback and exits with status 1
    (skipping JAX's shutdown barrier, which would wait for peers forever), and a
    daemon thread that polls for a peer's published error every `poll_s` seconds
    and then exits this process with status 71, naming the failed process and
    its error. A no-op without JAX's distributed runtime.
    """
    store, me, count = _runtime()
    if store is None or count == 1:
        return
    with _lock:
        if _installed.is_set():
            return
        previous = sys.excepthook

        def hook(kind: type[BaseException], error: BaseException,
                 tb: TracebackType | None) -> None:
            text = "".join(traceback.format_exception_only(kind, error)).strip()
            with contextlib.suppress(Exception):  # the runtime may be gone too; still exit
                store.key_value_set(f"{FAILED_KEY}{me}", text[:2000], allow_overwrite=True)
            previous(kind, error, tb)
            if me == 0:  # process 0 hosts the key-value store: let the peers read the error
                time.sleep(3 * poll_s)
            _exit(1)

        sys.excepthook = hook
        atexit.register(_stopping.set)  # runs before JAX's shutdown: a normal exit
        watchdog = threading.Thread(target=_watch, args=(store, me, poll_s),
                                    name="tilecore-fail-together", daemon=True)
        watchdog.start()
        _installed.set()


def _watch(store: KeyValueStore, me: int, poll_s: float) -> None:
    """Exit this process when a peer has published the error it died of, or when the
    job's key-value store (hosted by process 0) is gone while this process runs."""
    while not _stopping.wait(poll_s):
        try:
            failed = [(key, value) for key, value in store.key_value_dir_get(FAILED_KEY)
                      if not key.endswith(f"/{me}")]
        except Exception as error:
            if _stopping.is_set():
                return
            sys.stderr.write(
                f"\ntilecore: process {me} lost the job's coordination service (process 0 "
                f"has exited or failed: {error}); exiting (status {EXIT_CODE}) instead of "
                "waiting for it in a collective.\n")
            _exit(EXIT_CODE)
        if failed:
            key, error = sorted(failed)[0]
            sys.stderr.write(
                f"\ntilecore: process {key.rsplit('/', 1)[-1]} of this job failed with "
                f"{error!r}; process {me} exits too (status {EXIT_CODE}) instead of waiting "
                "for it in a collective.\n")
            _exit(EXIT_CODE)


def _exit(status: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _runtime() -> tuple[KeyValueStore | None, int, int]:
    import jax

    store = jax_store()
    if store is None:
        return None, 0, 1
    return store, jax.process_index(), jax.process_count()
