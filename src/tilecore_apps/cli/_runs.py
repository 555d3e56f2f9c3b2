"""Where `tilecore train` writes: a new run directory each time, or an explicit `--out`.

Without `--out`, every run gets `tilecore-train/run-NNN` (the next free number) and
`tilecore-train/latest` points at it, so running a command twice never collides with
an earlier run; `--resume` continues the newest run that holds a checkpoint. With
`--out DIR`, a DIR that already holds a run's outputs is refused unless `--resume`
(continue it) or `--overwrite` (delete those outputs and start over) says what to do.
Only the files a run writes are ever deleted, never anything else in DIR.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

from tilecore import checkpoint

DEFAULT_ROOT = Path("tilecore-train")
LATEST = "latest"
OUTPUTS = ("checkpoint", "summary.json", "loss_auc.png", "partition_load.png")
_RUN = re.compile(r"^run-(\d+)$")


class RunDir(NamedTuple):
    """The directory a run writes to, the step it resumes from (0: a fresh start), and
    a line for the user saying which it is."""

    path: Path
    start_step: int
    note: str


def resolve(out: Path | None, *, resume: bool, overwrite: bool, root: Path = DEFAULT_ROOT
            ) -> RunDir:
    """The directory of this run, created (or cleared, with `overwrite`) before it starts.

    Raises:
      ValueError: `out` holds an earlier run's outputs and neither `resume` nor
        `overwrite` is set, or `overwrite` is set without `out`.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: give one of them.")
    if out is None:
        if overwrite:
            raise ValueError(f"--overwrite needs --out DIR: without --out every run already "
                             f"writes a new directory under {root}/.")
        if root.exists() and not root.is_dir():
            raise ValueError(f"{root} is a file, where tilecore train keeps its run "
                             "directories; move it away or pass --out DIR.")
        if resume:
            newest = newest_run(root)
            if newest is not None:
                _claim(newest)
                return RunDir(newest, saved_step(newest), f"resuming the newest run, {newest}")
        path = new_run(root)
        _claim(path)
        note = (f"nothing to resume under {root}/ (no run has a checkpoint): starting a new "
                f"run in {path}" if resume else f"writing to {path}")
        return RunDir(path, 0, note)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a directory (new or holding a run).")
    out.mkdir(parents=True, exist_ok=True)
    _claim(out)
    if resume:
        step = saved_step(out)
        if step:
            return RunDir(out, step, f"resuming {out}")
        return RunDir(out, 0, f"nothing to resume in {out} (no checkpoint): starting from step 0")
    found = [name for name in OUTPUTS if (out / name).exists()]
    if found and not overwrite:
        raise ValueError(
            f"--out {out} already holds a run ({', '.join(found)}). Continue it with --resume, "
            f"start over with --overwrite (deletes those files), or leave out --out to write "
            f"a new run directory under {root}/.")
    for name in found:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    return RunDir(out, 0, f"overwriting {out}" if found else f"writing to {out}")


_claimed: dict[Path, int] = {}
"""The run directories this process writes, each held open and locked until `release`
(or the process's end)."""


def _claim(path: Path) -> None:
    """Lock run directory `path` for this process (an advisory `flock` on the directory,
    until `release` or the process's end), so that two commands never write one run: a
    second gets a ValueError naming the directory. Where locks are not supported,
    nothing is locked. A file where the run keeps its checkpoints is refused first."""
    path = path.resolve()
    if path in _claimed:
        return
    checkpoints = path / "checkpoint"
    if checkpoints.exists() and not checkpoints.is_dir():
        raise ValueError(f"{checkpoints} is a file, where tilecore train keeps its "
                         "checkpoints; move it away.")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"{path} is in use by another tilecore train; wait for it to end, "
                         "or write this run elsewhere (--out DIR).") from None
    except OSError:  # a file system without locks
        os.close(fd)
        return
    _claimed[path] = fd


def release(path: Path) -> None:
    """Unlock run directory `path` (the command that claimed it has finished with it)."""
    fd = _claimed.pop(path.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases its flock


def saved_step(directory: Path) -> int:
    """The newest intact checkpoint's step in `directory`'s run (0 if it has none).

    The step training resumes from: damaged newer checkpoints are skipped with a
    warning (`tilecore_apps.dlrm.latest_step`); a CheckpointCorruptError (a
    ValueError) says so when every one is damaged.
    """
    if not checkpoint.available_steps(directory / "checkpoint"):
        return 0
    from tilecore_apps.dlrm import latest_step  # the training stack, only when resuming

    return latest_step(directory / "checkpoint") or 0


def runs(root: Path) -> list[Path]:
    """The run directories under `root`, oldest (lowest number) first."""
    return [p for _, p in _numbered(root)]


def _numbered(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m[1]), p) for p in root.iterdir()
                  if (m := _RUN.match(p.name)) and p.is_dir())


def newest_run(root: Path) -> Path | None:
    """The newest run under `root` that holds a checkpoint (None if none does)."""
    return next((p for p in reversed(runs(root)) if saved_step(p)), None)


def new_run(root: Path) -> Path:
    """Create `root/run-NNN` with the next free number and point `root/latest` at it."""
    root.mkdir(parents=True, exist_ok=True)
    existing = _numbered(root)
    number = existing[-1][0] + 1 if existing else 1
    while True:
        path = root / f"run-{number:03d}"
        try:
            path.mkdir()  # atomic: two runs started at once get different numbers
            break
        except FileExistsError:
            number += 1
    _point_latest(root, path.name)
    return path


def discard_if_empty(path: Path) -> None:
    """Remove the run directory `path` if nothing was written to it (a run that failed)."""
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        remaining = runs(path.parent)
        if remaining:
            _point_latest(path.parent, remaining[-1].name)
        elif (path.parent / LATEST).is_symlink():
            (path.parent / LATEST).unlink()


def _point_latest(root: Path, name: str) -> None:
    """`root/latest` → `name`, replaced atomically; skipped where symlinks are not allowed."""
    tmp = root / f".{LATEST}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(name, target_is_directory=True)
        os.replace(tmp, root / LATEST)
    except OSError:
        tmp.unlink(missing_ok=True)
