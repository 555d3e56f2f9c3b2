"""Hostile cases between processes: a job whose processes disagree, then one that fails or dies.

Real JAX processes (gloo collectives over localhost) run `_together_worker.py`. The last
process holds a plan with another learning rate: every process must raise the same clear
error before any collective runs (gloo used to abort them without a Python error). Then
one process fails while the others wait for it in a collective it never joins; they must
exit non-zero within a bounded time naming it (they used to wait forever, and a failed
process never exited either). Three launches:

- coordinator-fails: 2 processes × 2 devices disagree and agree through the ops, then
  process 0, which hosts the job's key-value store, raises;
- worker-fails: 3 processes disagree and agree through `agree_on_plan` (no topology spans
  three processes' devices: nothing to compile), then process 1 raises;
- worker-killed: 3 processes, process 1 is killed by SIGKILL once its peers have heard
  from it. It says nothing; process 0 waits for it in a collective (gloo raises, naming
  no process), process 2 has finished and waits in JAX's shutdown barrier (nothing
  raises): both must notice its silence, here after `SILENT_S`, and name it; process 0
  must not take finished process 2 for dead.

`test_silence_*` and `test_fail_together_refuses_*` check the silence rule and its settings
in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import pytest

from _together_worker import POLL_S, SILENT_S
from _xla_flags import xla_flags
from test_distributed import _free_port, _gloo_missing, _useful_lines
from tilecore.distributed import fail_together
from tilecore.distributed._together import DONE, Silence

WORKER = Path(__file__).with_name("_together_worker.py")
BOUND_S = 60.0
"""The issue's bound: every peer of a failed process exits within this."""


class Launch(NamedTuple):
    processes: int
    devices: int
    """Per process."""
    failing: int
    how: Literal["raise", "kill", "short"]
    agree: Literal["ops", "plans", "none"]
    """How the processes first disagree, then agree (see `_together_worker.py`)."""


LAUNCHES = {"coordinator-fails": Launch(2, 2, 0, "raise", "ops"),
            "worker-fails": Launch(3, 1, 1, "raise", "plans"),
            "worker-killed": Launch(3, 1, 1, "kill", "none"),
            "worker-ends-early": Launch(2, 1, 1, "short", "none")}
MadeOnce = Callable[[str, Callable[[Path], object]], Path]


class Job(NamedTuple):
    launch: Launch
    returncodes: list[int | None]
    exited_at: list[float]
    seen: list[dict[str, Any]]
    logs: list[str]
    failed_at: float
    """When the failing process raised, or was killed."""


def _job(name: str, made_once: MadeOnce) -> Job:
    reason = _gloo_missing()
    if reason:
        pytest.skip(reason)
    out = made_once(f"together-{name}", lambda folder: (folder / "job.json").write_text(
        json.dumps(_run_job(LAUNCHES[name], folder)._asdict())))
    job = json.loads((out / "job.json").read_text())
    return Job(**{**job, "launch": Launch(*job["launch"])})


@pytest.fixture(scope="module", params=["coordinator-fails", "worker-fails"])
def failed(request: pytest.FixtureRequest, made_once: MadeOnce) -> Job:
    return _job(request.param, made_once)


@pytest.fixture(scope="module")
def killed(made_once: MadeOnce) -> Job:
    return _job("worker-killed", made_once)


@pytest.fixture(scope="module")
def ended_early(made_once: MadeOnce) -> Job:
    return _job("worker-ends-early", made_once)


def _run_job(launch: Launch, out: Path) -> Job:
    count = launch.processes
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=xla_flags(launch.devices))
    port = _free_port()
    logs = [open(out / f"log-{p}.txt", "w") for p in range(count)]  # noqa: SIM115
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(p), str(count), str(port),
                               str(out), str(launch.failing), launch.how, launch.agree],
                              env=env, stdout=log,
                              stderr=subprocess.STDOUT) for p, log in enumerate(logs)]
    exited_at = [0.0] * count
    failed_at = 0.0
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if launch.how == "kill" and not failed_at and (out / "ready").exists():
                procs[launch.failing].send_signal(signal.SIGKILL)
                failed_at = time.time()
            for k, proc in enumerate(procs):
                if proc.poll() is not None and not exited_at[k]:
                    exited_at[k] = time.time()
            time.sleep(0.1)
    finally:
        codes = [proc.poll() for proc in procs]
        for k, proc in enumerate(procs):  # the safety net: never leave a worker behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            elif not exited_at[k]:
                exited_at[k] = time.time()
        for log in logs:
            log.close()
    seen = [json.loads(path.read_text()) if (path := out / f"seen-{p}.json").exists() else {}
            for p in range(count)]
    if launch.how in ("raise", "short") and (out / "failed-at").exists():
        failed_at = float((out / "failed-at").read_text())
    return Job(launch, codes, exited_at, seen,
               ["\n".join(_useful_lines(out / f"log-{p}.txt")[-30:]) for p in range(count)],
               failed_at)


def test_processes_with_different_learning_rates_all_raise(failed: Job) -> None:
    job = failed
    for p, seen in enumerate(job.seen):
        message = seen.get("disagree")
        assert message, f"process {p} ran with a plan its peers do not hold:\n{job.logs[p]}"
        assert "processes hold different plans and hyperparameters" in message, message
        assert "table 'a'" in message and "learning_rate" in message, message
    assert all(seen.get("agree") == ["fa", "fb0", "fb1"] for seen in job.seen), job.seen


def _assert_survivors_exit(job: Job, failure: int | None, says: str) -> None:
    """The failing process ended with `failure` (exit status or -signal), every other one
    with 71 within the bound, saying `says`, and no collective returned."""
    failing = job.launch.failing
    assert job.failed_at, f"the failing process never got to fail:\n{job.logs[failing]}"
    for p, code in enumerate(job.returncodes):
        assert code is not None, f"process {p} hung:\n{job.logs[p]}"
        assert code == (failure if p == failing else 71), f"process {p} exited {code}:\n{job.logs[p]}"
        assert job.exited_at[p] - job.failed_at < BOUND_S, (p, job.exited_at[p] - job.failed_at)
        assert "collective_returned" not in job.seen[p]
        if p != failing:
            assert says in job.logs[p], job.logs[p]


def test_a_failed_process_ends_the_job_within_the_bound(failed: Job) -> None:
    failing = failed.launch.failing
    error = f"RuntimeError: empty batch on process {failing} (on purpose)"
    assert error in failed.logs[failing]
    _assert_survivors_exit(failed, 1, f"process {failing} of this job failed with {error!r}")


def test_a_killed_process_ends_the_job_within_the_bound(killed: Job) -> None:
    _assert_survivors_exit(killed, -signal.SIGKILL,
                           f"process {killed.launch.failing} of this job stopped answering "
                           f"for {SILENT_S:g} s (killed")
    # Silence it is: not sooner than SILENT_S after its last beat, which came at most one
    # beat (POLL_S) before the kill (a run under load ended 3.9 s after the kill).
    for p, at in enumerate(killed.exited_at):
        assert p == killed.launch.failing or at - killed.failed_at >= SILENT_S - POLL_S, (p, at)
    assert "finished" in killed.seen[2] and "waiting_since" in killed.seen[0], killed.seen


def test_silence_names_a_peer_whose_count_stands_still_for_silent_s() -> None:
    silence = Silence(4.0)
    assert silence.silent({"1": "1", "2": "7"}, now=0.0) is None
    assert silence.silent({"1": "2", "2": "7"}, now=3.9) is None
    assert silence.silent({"1": "3", "2": "7"}, now=4.0) == "2"
    assert silence.silent({"1": "3", "2": "8"}, now=7.9) is None  # "2" moved: judged anew
    assert silence.silent({"1": "3", "2": "8"}, now=8.0) == "1"


def test_silence_spares_peers_that_are_done_or_not_yet_counting() -> None:
    silence = Silence(4.0)
    assert silence.silent({"1": "5"}, now=0.0) is None
    assert silence.silent({"1": DONE}, now=1.0) is None
    assert silence.silent({"1": DONE, "2": "1"}, now=100.0) is None  # "2": first count
    assert silence.silent({"1": DONE, "2": "2"}, now=200.0) is None


def test_fail_together_refuses_a_silence_shorter_than_three_polls() -> None:
    with pytest.raises(ValueError, match=r"silent_s >= 3 \* poll_s"):
        fail_together(poll_s=1.0, silent_s=2.0)


def test_schedules_of_one_name_with_other_rates_make_other_fingerprints() -> None:
    """Processes whose schedules came from one factory with other rates (compared by
    name only) trained the halves of a table at different rates, in silence."""
    import tilecore as tc
    from tilecore.distributed._fingerprint import canonical

    def make_schedule(rate: float) -> Callable[[Any], float]:
        def schedule(step: Any) -> float:
            return rate
        return schedule

    a, b = (tc.SGD(learning_rate=make_schedule(rate)) for rate in (0.1, 0.5))
    assert canonical(a) != canonical(b)
    assert canonical(a) == canonical(tc.SGD(learning_rate=make_schedule(0.1)))
    assert canonical(a)["learning_rate"]["rates at steps"][0] == "0.1"


def test_a_process_that_runs_fewer_steps_ends_its_peers_naming_both_counts(
        ended_early: Job) -> None:
    """A process that ran out of batches first returned normally; its peer waited in the
    next step's collective until JAX's shutdown barrier timed out (5 minutes), then both
    aborted without a Python error."""
    job = ended_early
    assert all(code is not None for code in job.returncodes), job.returncodes
    assert job.returncodes[0] == 71, (job.returncodes, job.logs[0])
    assert "process 1 of this job finished after 2 training steps while process 0 has begun " \
           "step 3" in job.logs[0], job.logs[0]
    assert max(job.exited_at) - job.failed_at < BOUND_S, (job.exited_at, job.failed_at)
