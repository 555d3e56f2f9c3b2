"""Processes of one job agree before they start, and fail together when one fails.

Three failure modes of multi-process jobs end badly without this:

- processes whose plans differ (limits, learning rates, topology) run their
  collectives with buffers of different sizes: gloo aborts the process
  (`op.preamble.length <= op.nbytes`) with no Python exception;
- a process that raises leaves its peers waiting in a collective forever, and
  never exits itself (JAX's shutdown barrier waits for the peers);
- a process killed by a signal (SIGKILL, the OOM killer) says nothing: a peer in a
  collective with it gets gloo's "Connection closed by peer", which names no
  process, and a peer waiting elsewhere (the key-value store, JAX's shutdown
  barrier) waits until JAX's heartbeat times out (100 s by default) and aborts it,
  again without a Python exception.

`agree_on_plan` compares a fingerprint of the plan (every table with its optimizer
and hyperparameters, feature, stack, limit, the topology and config) and any
further hyperparameters the caller names, through JAX's distributed key-value
store, and raises the same `ValueError` on every process on a mismatch. The
device ops call it (through `ensure_agreed`) the first time they trace a plan in
a multi-process job. `fail_together` makes a process that dies of an uncaught
exception publish its error and exit at once; every process also bumps a count in
the store every second, and the first peer to see one stand still for `silent_s`
(30 s) publishes that silence. Every peer that reads either exits non-zero within
seconds, naming the process. (Process 0 hosts the store: when it is killed, JAX
itself ends every peer at once, an abort whose log blames the leader task. The
client's `missed_heartbeat_callback`, which `jax.distributed.initialize` does not
expose, cannot turn that into a Python error either: given a Python callable,
jaxlib 0.10.2 fails to hand it the `absl::Status` and terminates the process
(`std::bad_cast`), tried 2026-11-28.)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
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

TOGETHER_KEY = "tilecore/together/"
"""What `fail_together` publishes; its watchdog reads it all in one call."""
GONE_KEY = f"{TOGETHER_KEY}gone/"
"""`<GONE_KEY><process>` says why the process is gone: `failed with '<its error>'`, as it
published itself, or `stopped answering ...`, as the first peer to notice published."""
ALIVE_KEY = f"{TOGETHER_KEY}alive/"
"""`<ALIVE_KEY><process>` holds a count its watchdog bumps every poll, then `DONE`."""
DONE = "done"
"""The last count of a process that exited normally."""
EXIT_CODE = 71
"""What a process exits with when a peer failed (the failed one exits with 1)."""

_LOST_PEER = re.compile(r"gloo|nccl|closed by peer|reset by peer|broken pipe", re.I)
"""What a collective's error says when a peer died under it (gloo: "Connection closed by
peer [address]"): the error names no process, so the watchdog is left time to find it."""

_agreed: set[str] = set()
_lock = threading.Lock()
_publishing = threading.Lock()
_installed = threading.Event()
_stopping = threading.Event()
"""Set at a normal exit: the watchdog beats no more, and a lost store is no failure."""


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


def agree_on(items: Mapping[str, Any], what: str, remedy: str, *, name: str,
             timeout_s: float = 300.0) -> None:
    """Check that every process calls this with equal `items` (JSON-able after
    `canonical`): a ValueError on every process naming the processes and items that
    differ, and `remedy`; a TimeoutError naming those that did not come. Calls of one
    `name` pair up in the order each process makes them. With one process it returns at
    once."""
    store, me, count = _runtime()
    if store is None or count == 1:
        return
    agreement = DistributedAgreement(None, timeout_s=timeout_s, name=name, store=store,
                                     process_id=me, process_count=count)
    agreement.check_items({key: canonical(value) for key, value in items.items()}, what,
                          remedy)


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


def fail_together(*, poll_s: float = 1.0, silent_s: float = 30.0) -> None:
    """Make this process's failure, or death, end every process of the job.

    Installs, once (later calls change nothing):

    - a `sys.excepthook` that prints the traceback, publishes the error under
      `tilecore/together/gone/<process>` and exits with status 1 (skipping JAX's
      shutdown barrier, which would wait for the peers forever). The error of a
      collective that lost a peer (gloo's "Connection closed by peer", which names no
      process) first waits up to `silent_s + 3 * poll_s` for the watchdog to name it;
    - a daemon watchdog thread that every `poll_s` seconds bumps this process's count
      `tilecore/together/alive/<process>` and reads its peers'. It exits this process
      with status 71, naming the peer, when a peer is gone: it published the error it
      died of, or its count has not moved for `silent_s` seconds of this process's
      clock (it was killed, e.g. by the OOM killer, or hangs; the first peer to notice
      publishes that, and the others follow at their next poll); and when the
      key-value store is gone. Process 0 hosts the store: it waits `3 * poll_s`
      before it exits, so that its peers can read why.

    A peer is watched from its first count: call this right after
    `jax.distributed.initialize` to watch from the start (the ops install it when
    they first trace a plan); a peer killed before its first count is left to JAX's
    heartbeat. A process that exits normally publishes `done` at exit (before JAX's
    shutdown), so its silence is not taken for death, and watches on through JAX's
    shutdown barrier, which would otherwise wait for a dead peer. A process that
    leaves by `os._exit` publishes nothing: peers that run on for `silent_s` more
    take it for killed. When process 0 itself is killed, JAX's client ends every
    peer at once (an abort, not a Python error; its log blames the leader task).
    A no-op without JAX's distributed runtime.

    Raises:
      ValueError: unless `0 < 3 * poll_s <= silent_s`.
    """
    if not 0 < 3 * poll_s <= silent_s:
        raise ValueError(
            f"fail_together: {poll_s=} and {silent_s=}; a peer must have at least three "
            "polls to show it is alive: pass poll_s > 0 and silent_s >= 3 * poll_s.")
    store, me, count = _runtime()
    if store is None or count == 1:
        return
    with _lock:
        if _installed.is_set():
            return
        sys.excepthook = _excepthook(store, me, poll_s, silent_s, sys.excepthook)
        # Registered after JAX's shutdown, so it runs before it: a normal exit.
        atexit.register(_publish_done, store, me)
        watchdog = threading.Thread(target=_watch, args=(store, me, poll_s, silent_s),
                                    name="tilecore-fail-together", daemon=True)
        watchdog.start()
        _installed.set()


def _excepthook(store: KeyValueStore, me: int, poll_s: float, silent_s: float,
                previous: Any) -> Any:
    """`fail_together`'s `sys.excepthook`: print (through `previous`), publish, exit 1."""

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        text = "".join(traceback.format_exception_only(kind, error)).strip()
        previous(kind, error, tb)
        if _LOST_PEER.search(text):  # a collective lost a peer: let the watchdog name it
            sys.stderr.write(
                f"\ntilecore: process {me} lost a peer in a collective; waiting up to "
                f"{silent_s + 3 * poll_s:g} s to learn which process failed.\n")
            time.sleep(silent_s + 3 * poll_s)  # the watchdog exits (71) once it knows
        with contextlib.suppress(Exception):  # the runtime may be gone too; still exit
            store.key_value_set(f"{GONE_KEY}{me}", f"failed with {text[:2000]!r}",
                                allow_overwrite=True)
        _leave(1, me, poll_s)

    return hook


_steps = [0]
"""Training steps this process has begun (`note_step`)."""


def note_step() -> None:
    """Count one training step begun by this process (`pipelining.TrainStep` calls it).

    A process that exits normally publishes how many it ran with its `done`; a peer
    that begins more steps than that would wait in their collectives for ever, so its
    watchdog ends it at once, naming both counts."""
    _steps[0] += 1


def _publish_done(store: KeyValueStore, me: int) -> None:
    """At a normal exit: beat no more, and say `done` (a beat in flight never overwrites it),
    with the training steps this process ran if it counted any."""
    with _publishing:
        _stopping.set()
        with contextlib.suppress(Exception):
            store.key_value_set(f"{ALIVE_KEY}{me}",
                                f"{DONE} {_steps[0]}" if _steps[0] else DONE,
                                allow_overwrite=True)


def _ended_early(entries: list[tuple[str, str]], me: int) -> tuple[int, str] | None:
    """A peer that finished after fewer training steps than this process has begun, and
    why that ends this process; None if there is none."""
    for key, value in entries:
        parts = value.split()
        if (key.startswith(ALIVE_KEY) and not key.endswith(f"/{me}") and len(parts) == 2
                and parts[0] == DONE and parts[1].isdigit() and _steps[0] > int(parts[1])):
            return int(key.rsplit("/", 1)[-1]), (
                f"finished after {parts[1]} training steps while process {me} has begun step "
                f"{_steps[0]} (its collectives would wait for the finished one for ever: every "
                "process must run the same number of steps)")
    return None


class Silence:
    """Which peer's counter has not moved for `silent_s` seconds of this process's clock.

    A peer is judged from its first count on, and never once it is `DONE`; the
    clock is the reader's own, so the processes' clocks need not agree.
    """

    def __init__(self, silent_s: float) -> None:
        self._silent_s = silent_s
        self._heard: dict[str, tuple[str, float]] = {}
        """Peer → its last count and when (this process's monotonic clock) it changed."""

    def silent(self, counts: Mapping[str, str], now: float) -> str | None:
        """The first peer in `counts` (peer → its count) that has been silent too long."""
        for peer, count in counts.items():
            last = self._heard.get(peer)
            if last is None or last[0] != count:
                self._heard[peer] = (count, now)
            elif not count.startswith(DONE) and now - last[1] >= self._silent_s:
                return peer
        return None


def _watch(store: KeyValueStore, me: int, poll_s: float, silent_s: float) -> None:
    """Beat, then exit this process when a peer has failed, died or hung (publishing a
    silence it noticed first, for the others), or when the key-value store (hosted by
    process 0) is gone while this process runs."""
    silence = Silence(silent_s)
    beats = 0
    while True:
        try:
            with _publishing:  # `done` waits for a beat in flight, and is never overwritten
                if not _stopping.is_set():
                    beats += 1
                    store.key_value_set(f"{ALIVE_KEY}{me}", str(beats), allow_overwrite=True)
            entries = store.key_value_dir_get(TOGETHER_KEY)
        except Exception as error:
            if _stopping.is_set():  # JAX's shutdown has ended the runtime: a normal exit
                return
            sys.stderr.write(
                f"\ntilecore: process {me} lost the job's coordination service (process 0 "
                f"has exited, failed or been killed: {error}); exiting (status {EXIT_CODE}) "
                "instead of waiting for it in a collective.\n")
            _exit(EXIT_CODE)
        gone = sorted((int(key.rsplit("/", 1)[-1]), value) for key, value in entries
                      if key.startswith(GONE_KEY) and not key.endswith(f"/{me}"))
        silent = silence.silent({key.rsplit("/", 1)[-1]: value for key, value in entries
                                 if key.startswith(ALIVE_KEY) and not key.endswith(f"/{me}")},
                                time.monotonic())
        if not gone and silent is not None:
            gone = [(int(silent), f"stopped answering for {silent_s:g} s (killed, e.g. by "
                                  "the OOM killer, or hung)")]
            with contextlib.suppress(Exception):  # the peers that have not noticed follow
                store.key_value_set(f"{GONE_KEY}{silent}", gone[0][1], allow_overwrite=True)
        early = None if gone or _stopping.is_set() else _ended_early(entries, me)
        if early is not None:
            gone = [early]
            with contextlib.suppress(Exception):  # the finished one waits in JAX's shutdown
                store.key_value_set(f"{GONE_KEY}{me}", f"was ended: process {early[0]} "
                                    f"{early[1]}", allow_overwrite=True)
        if gone:
            peer, why = gone[0]
            sys.stderr.write(
                f"\ntilecore: process {peer} of this job {why}; process {me} exits too "
                f"(status {EXIT_CODE}) instead of waiting for it.\n")
            _leave(EXIT_CODE, me, poll_s)
        time.sleep(poll_s)


def _leave(status: int, me: int, poll_s: float) -> NoReturn:
    """Exit with `status`; process 0 hosts the key-value store, so it first waits three
    polls for its peers to read why."""
    if me == 0:
        time.sleep(3 * poll_s)
    _exit(status)


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
