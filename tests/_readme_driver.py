"""The driver of `test_readme.py`: one run of the README's steps, in this fresh process.

    python -u -P _readme_driver.py PROGRAM.json

`PROGRAM.json` holds the steps ("python" or "sh", text, README line), the README's path
and the two FIFOs the `.venv/bin/tilecore` shim talks over (see `test_readme.py`'s
docstring for the protocol and why). Each shell line runs in bash while this process
serves the `tilecore` calls bash makes; each Python block runs through `exec`, the
consecutive blocks in one namespace. Exits non-zero naming the first step that failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

Call = tuple[str, list[str], str, dict[str, str]]
"""A shim's request: its pid, the arguments, its working directory, its environment."""

SHELL_OWNED = {"_", "SHLVL", "PWD", "OLDPWD"}
"""What bash itself sets in the shim's environment."""


def request(buffer: bytes) -> tuple[Call, bytes] | None:
    """The first whole request in `buffer` (the shim's pid, cwd, argc, args, environment
    entries, an empty field) and the rest of `buffer`; None until one is whole."""
    fields = buffer.split(b"\0")
    if len(fields) < 4:
        return None
    argc = int(fields[2])
    ends = [i for i in range(3 + argc, len(fields) - 1) if not fields[i]]
    if not ends:
        return None
    pid, cwd, args, env = fields[0], fields[1], fields[3:3 + argc], fields[3 + argc:ends[0]]
    entries = (os.fsdecode(entry).partition("=") for entry in env)
    call = (pid.decode(), [os.fsdecode(arg) for arg in args], os.fsdecode(cwd),
            {key: value for key, _, value in entries})
    return call, b"\0".join(fields[ends[0] + 1:])


def differing(env: dict[str, str]) -> list[str]:
    """The variables in which `env` differs from this process's environment."""
    keys = (env.keys() | os.environ.keys()) - SHELL_OWNED
    return sorted(key for key in keys if env.get(key) != os.environ.get(key))


def redirected(pid: str) -> list[int]:
    """The shim's stdin/out/err that are not this process's."""
    def same(fd: int) -> bool:
        with contextlib.suppress(OSError):  # no /proc: a process of its own
            ours, shim = os.fstat(fd), os.stat(f"/proc/{pid}/fd/{fd}")
            return (shim.st_dev, shim.st_ino) == (ours.st_dev, ours.st_ino)
        return False

    return [fd for fd in (0, 1, 2) if not same(fd)]


def status_of(code: object) -> int:
    """The exit status of `sys.exit(code)`."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def tilecore(main: Callable[[list[str]], Any], call: Call) -> str:
    """The reply to one call: its exit status, run here; or "exec" where it must run as a
    process of its own. What would not carry from one process to the next is put back."""
    pid, argv, cwd, env = call
    print(f"+ tilecore {shlex.join(argv)}", flush=True)
    if keys := differing(env):
        print(f"(as a process of its own: its environment differs in {keys})", flush=True)
        return "exec"
    if fds := redirected(pid):
        print(f"(as a process of its own: file descriptors {fds} are redirected)", flush=True)
        return "exec"
    environ, workdir = dict(os.environ), os.getcwd()
    os.chdir(cwd)
    try:
        with warnings.catch_warnings():
            return str(status_of(main(argv)))
    except SystemExit as exit:  # argparse's usage errors, --help, --version
        return str(status_of(exit.code))
    except Exception:
        traceback.print_exc()
        return "1"
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update(environ)


def shell(line: str, main: Callable[[list[str]], Any], requests: int, replies: str) -> int:
    """bash's exit status for `line`, serving the `tilecore` calls it makes."""
    bash, buffer = subprocess.Popen(["bash", "-c", line]), b""
    while True:
        if select.select([requests], [], [], 0.05)[0]:
            buffer += os.read(requests, 1 << 16)
            while (found := request(buffer)) is not None:
                call, buffer = found
                status = tilecore(main, call)
                with open(replies, "w") as reply:
                    reply.write(f"{status}\n")
        elif bash.poll() is not None:
            return bash.returncode


def python(text: str, line: int, readme: str, namespace: dict[str, object]) -> None:
    """Run a Python block with the warnings the suite runs under (pyproject's filters)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="numba.*")
            exec(compile("\n" * (line - 1) + text, readme, "exec"), namespace)
    except Exception:
        traceback.print_exc()
        sys.exit(f"\nFAILED: the Python block at README.md line {line}")


def drive(steps: Sequence[tuple[str, str, int]], readme: str, requests_path: str,
          replies: str) -> None:
    """Every step in order; exits at the first that fails."""
    import jax

    jax.devices()  # JAX starts here, with the devices XLA_FLAGS gives it
    (script,) = entry_points(group="console_scripts", name="tilecore")
    main = script.load()
    requests = os.open(requests_path, os.O_RDWR)  # held open: a read waits for a shim
    namespace: dict[str, object] = {}  # consecutive Python blocks are one program
    for kind, text, line in steps:
        print(f"\n>>> the Python block at README.md line {line}" if kind == "python"
              else f"\n$ {text}", flush=True)
        began = time.perf_counter()
        if kind == "python":
            python(text, line, readme, namespace)
        elif status := shell(text, main, requests, replies):
            sys.exit(f"\nFAILED (exit status {status}): README.md line {line}: $ {text}")
        print(f"({time.perf_counter() - began:.1f} s)", flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as file:
        spec = json.load(file)
    drive(spec["steps"], spec["readme"], spec["requests"], spec["replies"])
