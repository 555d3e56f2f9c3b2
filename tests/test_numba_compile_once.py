"""`tilecore._numba.njit`: a kernel compiled by one process is loaded, not compiled again,
by a process that asked for it meanwhile (input workers and test workers start together
on a cold cache).

The test holds the kernel's compile lock itself, starts a second process that calls the
kernel, compiles the kernel while that process waits, and lets go: the second process
must find the machine code in the cache (a hit, no compile of its own).
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tilecore._numba import compile_lock

MODULE = textwrap.dedent("""
    from tilecore._numba import njit


    @njit(cache=True, nogil=True)
    def inner(x):
        return x * 3


    @njit(cache=True, nogil=True)
    def kernel(x):
        return inner(x) + 1
""")
CHILD = textwrap.dedent("""
    import json, sys
    import kernels_under_test as m
    print("calling", flush=True)
    value = m.kernel(4)
    print(json.dumps({"value": value,
                      "hits": sum(m.kernel.stats.cache_hits.values()),
                      "misses": sum(m.kernel.stats.cache_misses.values())}), flush=True)
""")


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    (tmp_path / "kernels_under_test.py").write_text(MODULE)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("kernels_under_test", None)
    import numba.core.config

    monkeypatch.setattr(numba.core.config, "CACHE_DIR", str(tmp_path / "cache"))
    yield importlib.import_module("kernels_under_test")
    sys.modules.pop("kernels_under_test", None)


def _lock_of(dispatcher: object) -> str:
    cache = dispatcher._cache  # type: ignore[attr-defined]
    return os.path.join(cache.cache_path, f"{cache._impl.filename_base}.lock")


def test_a_process_waiting_for_a_compile_loads_it(kernels: object, tmp_path: Path) -> None:
    kernel = kernels.kernel  # type: ignore[attr-defined]
    lock = _lock_of(kernel)
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    with compile_lock(lock):
        child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "calling"
        time.sleep(1.0)  # the child now waits for the lock (it cannot compile before we let go)
        assert child.poll() is None, child.communicate()
        assert kernel(4) == 13  # this process compiles and writes the cache
        assert sum(kernel.stats.cache_misses.values()) == 1
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"value": 13, "hits": 1, "misses": 0}, (seen, err)


def test_compiles_in_one_process_nest_and_need_no_lock(
        kernels: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel compiled inside another's compile (same process) does not wait for itself;
    a lock file that cannot be made, or a file system without locks, locks nothing."""
    assert kernels.kernel(2) == 7  # type: ignore[attr-defined]  # compiles inner inside kernel
    assert Path(_lock_of(kernels.inner)).exists()  # type: ignore[attr-defined]
    entered = []
    with compile_lock(str(tmp_path / "no such folder" / "x.lock")):
        entered.append("no folder")

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with compile_lock(str(tmp_path / "x.lock")):
        entered.append("no locks")
    assert entered == ["no folder", "no locks"]


STAMPED = textwrap.dedent("""
    import json, sys
    import tilecore._numba as nb
    if len(sys.argv) > 1:
        nb.source_stamp = lambda: sys.argv[1]  # tilecore's numba sources, as if edited
    import kernels_under_test as m
    m.kernel(4)
    print(json.dumps([sum(m.kernel.stats.cache_hits.values()),
                      sum(m.kernel.stats.cache_misses.values())]))
""")


def test_an_edit_to_any_numba_source_compiles_every_kernel_again(
        kernels: object, tmp_path: Path) -> None:
    """numba checks a cached function against its own file only, so a kernel whose helper
    in another module changed would load stale machine code; the stamp of all of
    tilecore's numba sources is part of every cached function's key."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))

    def run(*stamp: str) -> list[int]:
        done = subprocess.run([sys.executable, "-c", STAMPED, *stamp], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run() == [0, 1]  # compiled
    assert run() == [1, 0]  # loaded
    assert run("edited") == [0, 1]  # compiled again: the sources changed
    assert run("edited") == [1, 0]


def test_the_stamp_covers_numba_modules_only(tmp_path: Path) -> None:
    from tilecore._numba import _stamp_of  # pyright: ignore[reportPrivateUsage]

    def stamp(files: dict[str, str]) -> str:
        root = tmp_path / f"pkg{len(list(tmp_path.iterdir()))}"
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        return _stamp_of(root)

    base = {"a.py": "import numba\n", "sub/b.py": "from numba import njit\n", "c.py": "x = 1\n"}
    first = stamp(base)
    assert stamp(base) == first
    assert stamp({**base, "c.py": "x = 2\n"}) == first  # no numba code: not part of it
    assert stamp({**base, "sub/b.py": "from numba import njit  # edited\n"}) != first
    assert stamp({**base, "d.py": "import numba as nb\n"}) != first  # a new numba module


HEALED = textwrap.dedent("""
    import json, warnings
    from tilecore._numba import cfunc, njit


    @njit(cache=True)
    def triple(x):
        return x * 3


    @cfunc("int64(int64)", cache=True)
    def add_one(x):
        return x + 1


    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = triple(4)
    print(json.dumps({"values": [value, add_one.ctypes(4)],
                      "warnings": [str(w.message) for w in seen]}))
""")


def test_a_damaged_cache_entry_is_compiled_and_written_again(tmp_path: Path) -> None:
    """A truncated or overwritten index of numba's cache raised an UnpicklingError from
    deep inside numba in every later process (and turned the CPU kernels off through the
    wing's probe): now the entry is dropped with a warning naming it, compiled and written
    again, and the next process loads it."""
    (tmp_path / "healed_module.py").write_text(HEALED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]),
               NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    stderr = []

    def run() -> dict[str, list[object]]:
        done = subprocess.run([sys.executable, "-c", "import healed_module"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stderr
        stderr.append(done.stderr)
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run() == {"values": [12, 5], "warnings": []}  # compiled and written
    indexes = sorted((tmp_path / "cache").rglob("*.nbi"))
    assert len(indexes) == 2
    indexes[0].write_bytes(b"")  # truncated to nothing
    indexes[1].write_bytes(b"\x80\x05garbage" * 10)  # overwritten
    first = run()
    assert first["values"] == [12, 5]
    # The cfunc compiles at import, before the module records warnings: its warning goes
    # to stderr; the njit function's is recorded.
    assert len(first["warnings"]) == 1
    assert "cannot be loaded" in str(first["warnings"][0]) and "triple" in str(
        first["warnings"][0])
    assert "cannot be loaded" in stderr[1] and "add_one" in stderr[1]
    assert run() == {"values": [12, 5], "warnings": []}  # written again, loaded
    assert "cannot be loaded" not in stderr[2]
