"""The README works as written: every shell and Python block, in document order, run twice
in one fresh directory (the repository's rule: every command the README shows works when
run in order, and again), at a small size through documented flags.

Each run is one fresh Python process, the driver (`_readme_driver.py`), which
takes the README's steps in order: each shell line runs in bash, each Python block through
`exec`. In the fresh directory `.venv/bin/tilecore` (also first on PATH) is a shim that
hands its arguments, working directory and environment to the driver; the driver calls the
`tilecore` console script's `main` (as pyproject.toml names it) in its own process and
hands the exit status back. So bash still reads every line as it would for a reader
(quotes, variables, `make bench`'s `for` loop, `|| exit 1`) and every `tilecore` call it
makes runs, while a run pays for jax, flax and numba's imports once instead of once per
command (~1.7 CPU-s each, ~20 commands a run).

What would not carry from one `tilecore` process to the next is put back after each call:
os.environ, the working directory, the warnings filters. JAX starts before the first call,
with two CPU devices: the most any README command asks for, so `train --devices 2` runs
in the driver too (a command without `--devices` uses one device whatever JAX has). A
reader's one-device process runs such a command again in a child process: test_train and
test_bench_step check that path. A call whose environment
differs from the driver's (`VAR=x tilecore ...`) runs as a process of its own, since the
driver's imports have read the environment already.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tilecore_apps._devices import with_device_count

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DRIVER = Path(__file__).parent / "_readme_driver.py"
"""Runs one pass over the README (a script of its own, started fresh for each run)."""
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL = ("bash", "sh", "shell", "console")  # console: the commands are the `$ ` lines
NOT_RUN = {"": "plain text (the layout tree)"}

# Lines that cannot run inside the test suite, with the reason. The test asserts that
# these are exactly the lines it leaves out, so a new README command cannot slip by unrun.
SKIPPED = {
    "make test": "runs this test suite itself (after installing the dev tools)",
}
# `make` targets run as the commands `make -n` prints for them, installing nothing (`-o
# install`: this test runs in the installed venv), then made small like every other line.
MADE = ("make demo", "make bench")

# The small size: documented flags appended to each `tilecore` command (argparse keeps a
# flag's last value), so that each runs its usual code path in seconds.
SMALL = {
    "train": "--steps 2 --batch-size 64 --eval-batches 1 --tune-batches 1",
    "data": "--rows 512 --batch-size 64",
    "limits": "--batches 1",
    "demo": "--steps 1",
    "bench preprocess": "--repeats 1 --warmup 0 --batches 1",
    "bench step": "--batch-size 64 --max-vocab 1000 --repeats 1 --warmup 1 --batches 1",
    "bench train": "--batch-size 64 --steps 3 --repeats 1 --staged 1",
}
# Where a command asks for worker processes: still worker processes, one, on a small host.
FEWER = {"--input-processes": "1"}
COMMAND = re.compile(r"(?:\S*/)?tilecore (bench \w+|\w+)[^;|&#\n]*")


def _blocks() -> list[tuple[str, str]]:
    """The README's fenced blocks in document order: (language, text)."""
    return FENCE.findall(README.read_text())


def _commands(language: str, text: str) -> list[str]:
    lines = text.replace("\\\n", " ").splitlines()
    if language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    lines = [line.split(" #", 1)[0].strip() for line in lines]
    return [line for line in lines if line and not line.startswith("#")]


def _small(command: str) -> str:
    """`command` with the small-size flags appended to each `tilecore` invocation in it."""

    def shrink(match: re.Match[str]) -> str:
        call = match[0].rstrip()
        fewer = [f"{flag} {value}" for flag, value in FEWER.items() if flag in call.split()]
        return " ".join([call, SMALL[match[1]], *fewer]) + " "

    return COMMAND.sub(shrink, command)


def _make_n(line: str, cwd: Path) -> str:
    """The commands `make <target>` runs, but for installing."""
    target = line.removeprefix("make ")
    # Not a sub-make of `make test`'s: no "Entering directory" lines, no inherited flags.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    done = subprocess.run(["make", "-n", "--no-print-directory", "-o", "install", "-f",
                           str(ROOT / "Makefile"), target],
                          cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return done.stdout.replace("\\\n", " ")


def _program(cwd: Path) -> tuple[list[tuple[str, str, int]], set[str]]:
    """The README as steps ("python" or "sh", text, README line of the block) in order, and
    the lines left out."""
    steps: list[tuple[str, str, int]] = []
    skipped: set[str] = set()
    readme = README.read_text()
    for match in FENCE.finditer(readme):
        language, text = match[1], match[2]
        line = readme.count("\n", 0, match.start(2)) + 1
        if language == "python":
            steps.append(("python", text, line))
            continue
        assert language in (*SHELL, *NOT_RUN), f"README block ```{language}: run it or say why not"
        for command in _commands(language, text) if language in SHELL else []:
            if command in SKIPPED:
                skipped.add(command)
            elif command in MADE:
                steps.append(("sh", _small(_make_n(command, cwd)), line))
            else:
                assert not re.match(r"(make|pip|python3? -m pip|uv)\b", command), (
                    f"the README's {command!r} would install or run the suite: add it to MADE "
                    f"or SKIPPED (with the reason) in {__file__}")
                steps.append(("sh", _small(command), line))
    return steps, skipped


def _shim(requests: Path, replies: Path, real: Path) -> str:
    """`.venv/bin/tilecore` in the fresh directory: the call goes to the driver."""
    return f"""#!/bin/bash
# tests/test_readme.py: `tilecore "$@"` runs in the test's driver process, which replies
# with its exit status, or with `exec`: run it as a process of its own. The request is
# written from a subshell, so that this process's own stdout, which the driver compares
# with its own, is never the FIFO.
( printf '%s\\0' "$$" "$PWD" "$#" "$@"; env -0; printf '\\0' ) > {shlex.quote(str(requests))}
read -r status < {shlex.quote(str(replies))}
if [ "$status" = exec ]; then exec {shlex.quote(str(real))} "$@"; fi
exit "$status"
"""


def test_first_screen_has_the_two_set_up_commands() -> None:
    text = README.read_text()
    language, block = _blocks()[0]
    assert text[: text.index(block)].count("\n") < 24, "the set-up block is off the first screen"
    assert language in SHELL and _commands(language, block) == ["make demo", "make test"]


def test_small_size_flags_are_documented() -> None:
    (command_line,) = entry_points(group="console_scripts", name="tilecore")
    main = command_line.load()  # what the `tilecore` command runs
    for command, flags in SMALL.items():
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
            main([*command.split(), "--help"])
        for flag in [f for f in flags.split() if f.startswith("--")]:
            assert f"{flag} " in shown.getvalue(), f"`tilecore {command} --help` lacks {flag}"


def test_readme_runs_in_order_twice(tmp_path: Path) -> None:
    fresh, driver = tmp_path / "fresh", tmp_path / "driver"  # the README runs in `fresh`
    bin_dir = fresh / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    driver.mkdir()
    requests, replies = driver / "requests", driver / "replies"
    os.mkfifo(requests)
    os.mkfifo(replies)
    # The README's `.venv/bin/tilecore`: the shim; `exec` runs the one beside this interpreter.
    real = Path(sys.executable).parent / "tilecore"
    (bin_dir / "tilecore").write_text(_shim(requests, replies, real))
    (bin_dir / "tilecore").chmod(0o755)
    steps, skipped = _program(fresh)
    assert skipped == set(SKIPPED), f"SKIPPED names lines the README no longer has: {SKIPPED}"
    program = driver / "program.json"
    program.write_text(json.dumps({"steps": steps, "readme": str(README),
                                   "requests": str(requests), "replies": str(replies)}))
    # JAX's compilation cache, in this directory only: the second run compiles nothing again.
    # Every program is written (the suite writes only slow ones, see conftest): here each
    # is used twice (measured: 43 s for the test so, 47 s writing only the slow ones).
    env = {**os.environ, "MPLBACKEND": "Agg",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "JAX_COMPILATION_CACHE_DIR": str(fresh / ".jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), 2)  # see the docstring
    for run in ("first", "second"):
        # -u: the driver's output and bash's interleave in order; -P: nothing from `fresh`
        # shadows a module.
        done = subprocess.run([sys.executable, "-u", "-P", str(DRIVER), str(program)],
                              cwd=fresh, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert done.returncode == 0, (
            f"the README failed on the {run} run in order, in {fresh}:\n{done.stdout[-6000:]}")
