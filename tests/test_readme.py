"""The README works as written: every shell and Python block, in document order, run twice
in one fresh directory (the repository's rule: every command the README shows works when
run in order, and again), at a small size through documented flags."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
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
    done = subprocess.run(["make", "-n", "-o", "install", "-f", str(ROOT / "Makefile"), target],
                          cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.replace("\\\n", " ")


def _program(cwd: Path) -> tuple[list[tuple[str, str]], set[str]]:
    """The README as steps ("python" or "sh", text) in order, and the lines left out."""
    steps: list[tuple[str, str]] = []
    skipped: set[str] = set()
    for language, text in _blocks():
        if language == "python":
            steps.append(("python", text))
            continue
        assert language in (*SHELL, *NOT_RUN), f"README block ```{language}: run it or say why not"
        for line in _commands(language, text) if language in SHELL else []:
            if line in SKIPPED:
                skipped.add(line)
            elif line in MADE:
                steps.append(("sh", _small(_make_n(line, cwd))))
            else:
                assert not re.match(r"(make|pip|python3? -m pip|uv)\b", line), (
                    f"the README's {line!r} would install or run the suite: add it to MADE "
                    f"or SKIPPED (with the reason) in {__file__}")
                steps.append(("sh", _small(line)))
    return steps, skipped


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


def test_readme_runs_in_order_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's `.venv/bin/tilecore`: the one installed beside this interpreter.
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "tilecore").symlink_to(Path(sys.executable).parent / "tilecore")
    steps, skipped = _program(tmp_path)
    assert skipped == set(SKIPPED), f"SKIPPED names lines the README no longer has: {SKIPPED}"
    # JAX's compilation cache, in this directory only: the second run compiles nothing again.
    env = {**os.environ, "MPLBACKEND": "Agg",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / ".jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    monkeypatch.chdir(tmp_path)
    for run in ("first", "second"):
        namespace: dict[str, object] = {}  # consecutive Python blocks are one program
        for kind, text in steps:
            if kind == "python":
                exec(compile(text, str(README), "exec"), namespace)
                continue
            done = subprocess.run(["bash", "-c", text], cwd=tmp_path, env=env,
                                  capture_output=True, text=True)
            assert done.returncode == 0, (
                f"a README command failed on the {run} run in order, in {tmp_path}:\n"
                f"$ {text}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
