"""Shared test set-up: one JAX compilation cache and XLA's quick compile mode for the
session, a deterministic hypothesis profile, the kernel-path and full-optimisation
fixtures, and `made_once` for expensive results (subprocess runs) that several test
modules or xdist workers share."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from _quick_xla import with_quick_flags

# One JAX compilation cache for the session and the sessions after it, as numba's cache
# is for the kernels: the xdist workers and the subprocesses the tests start inherit it
# (JAX reads it on import), so a program compiled in one process, or in an earlier run, is
# loaded, not compiled again. Only programs that took 0.2 s or more to compile are
# written: serialising and writing each of the thousands of small ones cost more than
# compiling them again (a cold run on 2 cores: 321-330 s with every program written,
# 262-270 s so; a warm run took 167-181 s and takes 183-197 s). Entries are keyed by
# the program, the compile options and the JAX version; the least recently used go
# beyond 1 GiB. `jax.monitoring`'s compile event still fires on a load, so tests that
# count compilations count loads too.
# The cache sits beside tilecore's kernel cache (`$TILECORE_CACHE_DIR`, else
# `~/.cache/tilecore`), or in a temporary directory where that cannot be written.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = os.path.join(os.environ.get("TILECORE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tilecore"),
        "jax-tests")
    with contextlib.suppress(OSError):
        os.makedirs(_cache, exist_ok=True)
    if not os.access(_cache, os.W_OK):
        _cache = tempfile.mkdtemp(prefix="tilecore-tests-jax-cache-")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 30))

# The suite checks results, not speed, and most of its time went to XLA compiling programs
# that then run once or twice on tiny inputs. JAX's own switch for that trade
# (`jax_disable_most_optimizations`: LLVM at level 0, no expensive passes; the HLO passes
# still run) roughly halves each compile, in this process and in every child, which
# inherits the variable. `tilecore train`, the benchmarks and a user's program keep full
# optimisation; a test whose bits depend on the generated code asks for it
# (`fully_optimised`).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# Two XLA:CPU switches of the same trade, for the same reason. XLA's newer MLIR fusion
# emitters compile a fusion about twice as slowly as the classic ones (measured: the XLA
# compile time of six op-heavy test files on a cold cache, 37.5 s -> 16.9 s), and its
# parallel code generation splits each module over threads that the test workers already
# keep busy (16.9 s -> 13.4 s). Both change how XLA compiles, not what a program means;
# `tilecore train`, the benchmarks and a user's program keep XLA's defaults. Subprocesses
# inherit XLA_FLAGS (`_xla_flags.xla_flags` keeps these when it sets a device count).
# The switches XLA does not know are left out (`_quick_xla`); the answers are kept beside the
# compilation cache.
os.environ["XLA_FLAGS"] = with_quick_flags(os.environ.get("XLA_FLAGS", ""),
                                           os.environ["JAX_COMPILATION_CACHE_DIR"])


import jax
import pytest
from hypothesis import HealthCheck, settings

# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# the suite starts about a hundred Python processes (workers, examples, the README's
# commands, multi-process jobs), and each compiled tilecore's sources again, and pytest
# rewrote every test module again in each worker: 25 to 35 CPU-s of a cold run on
# 2 cores. The caches go where Python keeps them (`__pycache__`, ignored by git).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

settings.register_profile(
    "tilecore",
    derandomize=True,
    max_examples=60,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("tilecore"), max_examples=1000)
settings.load_profile(os.environ.get("TILECORE_HYPOTHESIS_PROFILE", "tilecore"))


@pytest.fixture(params=["ffi", "xla"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`$TILECORE_KERNELS`: numba CPU kernels (ffi) or plain XLA ops.

    The choice is cached per process, so the cache is cleared before and after: each
    test runs the path it names, whichever ran before it. The CPU kernels need JAX's
    CPU backend; on an accelerator only the XLA path runs.
    """
    from tilecore.ops._backend import wing

    if request.param == "ffi" and jax.default_backend() != "cpu":
        pytest.skip(f"the CPU kernels do not run on the {jax.default_backend()} backend")
    monkeypatch.setenv("TILECORE_KERNELS", request.param)
    wing.cache_clear()
    yield request.param
    monkeypatch.undo()
    wing.cache_clear()


@pytest.fixture
def fully_optimised() -> Iterator[None]:
    """Compile the test's programs as a user's program is compiled (full optimisation).

    For properties of the generated code rather than of the computation: two programs
    that agree to the bit at full optimisation may differ in the last place at level 0
    (which fuses and contracts differently). JAX's in-memory caches are cleared on the
    way in and out, so no program compiled at the other level is reused.
    """
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
        jax.clear_caches()


MadeOnce = Callable[[str, Callable[[Path], object]], Path]


@pytest.fixture(scope="session")
def made_once(tmp_path_factory: pytest.TempPathFactory) -> MadeOnce:
    """`made_once(name, make)`: the folder `name`, filled by `make(folder)` once per session.

    Under pytest-xdist every worker that runs one of a module's tests builds that
    module's fixtures itself, and builds them again when work stealing hands it the
    module's tests after another module's; for a fixture that runs a subprocess for
    half a minute that is the cost of a whole test file. The workers share the
    session's temporary root, so the first to ask makes the folder (under a lock; the
    others wait for it) and every later ask, from any worker, reads what it made. A
    `make` that raises leaves nothing behind: the next ask tries again.
    """
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, make: Callable[[Path], object]) -> Path:
        folder, done = root / f"once-{name}", root / f"once-{name}.done"
        with open(root / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not done.exists():
                if folder.exists():  # a make that raised part-way
                    shutil.rmtree(folder)
                folder.mkdir()
                make(folder)
                done.touch()
        return folder

    return get


SLOW_MODULES_FIRST = (
    "test_readme", "test_examples", "test_train", "test_ops_minibatching",
    "test_compat_auto_pipelining", "test_ops_half", "test_input_slots", "test_ops_extras",
    "test_hostile_processes", "test_distributed", "test_hostile_checkpoints", "test_layers",
    "test_ops_multidevice", "test_minibatching_end_to_end", "test_bench_step", "test_hostile_ops",
    "test_checkpoint", "test_ffi", "test_pipelining", "test_reference_checkpoint",
    "test_compat_checkpoint", "test_cli_data", "test_train_input", "test_compat_ops",
)
"""Test files whose tests run subprocesses or compile many programs, slowest first
(measured with `pytest --durations`)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the slow files first, each file's tests still together and in order.

    pytest-xdist's work stealing hands each worker a contiguous share of this list
    and lets an idle worker take the end of a busy one's: with the long tests at the
    front, the session ends on short ones, and no worker is left running a minute-long
    subprocess while the other waits."""
    rank = {name: k for k, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
