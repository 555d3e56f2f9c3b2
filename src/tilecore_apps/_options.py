"""argparse value types: a bad option value is a usage error naming the flag and the value.

argparse prints `tilecore train: error: argument --batch-size: must be an integer >= 1,
got '0'`, so every check here says what the value must be and what was received; the
flag's name is added by argparse.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from pathlib import Path


def _number(text: str, kind: type[int] | type[float], low: float, *, strict: bool = False
            ) -> int | float:
    """`text` as a `kind` >= `low` (> `low` when `strict`), else an argparse usage error."""
    name = "an integer" if kind is int else "a number"
    bound = f"> {low}" if strict else f">= {low}"
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {name} {bound}, got {text!r}") from None
    if not (value > low if strict else value >= low):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be {name} {bound}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a batch size, a step count)."""
    return int(_number(text, int, 1))


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a queue depth, a worker count where 0 means none)."""
    return int(_number(text, int, 0))


def seed_int(text: str) -> int:
    """argparse type: a random seed, an integer in [0, 2**32) (what every generator the
    commands seed takes)."""
    value = int(_number(text, int, 0))
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a learning rate)."""
    value = float(_number(text, float, 0, strict=True))
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a headroom fraction)."""
    value = float(_number(text, float, 0))
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers >= 1, e.g. `500,2000,100000`."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be integers >= 1 separated by commas, e.g. 500,2000; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"must be integers >= 1 separated by commas, e.g. 500,2000; got {text!r}")
    return values


def _blocked_by(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` that is not a directory (no file can be
    made below it), if any."""
    for parent in path.absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def output_file(text: str) -> Path:
    """argparse type: a file to write (a summary, results): not an existing directory, nor
    below a file. Checked before the command runs, not once its work is done."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    blocker = _blocked_by(path)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(blocker)!r} is a file")
    return path


def output_dir(text: str) -> Path:
    """argparse type: a directory to write into (made if missing): not an existing file,
    nor below one."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a directory")
    blocker = _blocked_by(path)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"cannot make {text!r}: {str(blocker)!r} is a file")
    return path


def program(text: str) -> Path:
    """argparse type: a program to run (a Python: `--peer-python`), a name found on PATH or
    the path of an executable file; an empty name, a directory, a missing or a
    non-executable file is refused before the command runs."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a program to run, e.g. a venv's bin/python; "
                                         f"got {text!r}")
    found = shutil.which(text) if os.sep not in text else None
    if found is not None:
        return Path(found)
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a program, e.g. "
                                         "a venv's bin/python")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file (nor a program on PATH)")
    if not os.access(path, os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not executable; give a program, e.g. "
                                         "a venv's bin/python")
    return path.absolute()  # a bare name of a file here is run, not looked up on PATH
