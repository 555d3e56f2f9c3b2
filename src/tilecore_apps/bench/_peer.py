"""`tilecore bench step --peer-python`: the same batches through FBGEMM, in the same run.

The peer runs in its own Python (`peers/fbgemm_tbe.py` beside this module, a script
that imports torch and fbgemm-gpu-cpu, never tilecore), on the IDs tilecore's step
saw; this module writes them out, runs it, and reads its timings back. Also here:
the copy bandwidth where the tables live, and the bytes a forward pass and an update
must move: the yardsticks of their bytes per second.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import tilecore as tc

from .._signals import handling_signals

PEER_OPTIMIZERS = {"sgd": "sgd", "adagrad": "adagrad"}
"""tilecore optimizer → the FBGEMM optimizer with the same update (exact, touched rows).
FBGEMM's CPU kernels train with SGD, Adagrad and row-wise Adagrad only (not Adam);
tilecore has no row-wise Adagrad."""

PEER_WEIGHTS = {"float32": "fp32", "float16": "fp16"}
"""tilecore table storage → FBGEMM's `weights_precision` (both round updates of half
tables stochastically). FBGEMM's CPU kernels do not train bfloat16 tables."""

PEER_WARMUP = 5
"""FBGEMM's first backward calls run several times slower than later ones (its own set-up):
the peer warms up at least this many calls."""

PROBE_TIMEOUT_S = 120.0
"""Seconds `check_peer` gives `--peer-python` to import torch and FBGEMM (a cold start
from a slow disk takes tens of seconds): a Python that never returns is stopped."""

PEER_START_S = 600.0
"""Seconds the peer run may take besides its calls: importing torch and FBGEMM, building
and initialising the tables (the workload's full vocabularies), reading the batches."""

PEER_CALL_S = 60.0
"""Seconds the peer run may take per forward or step call (warm-up and timed alike): a
generous bound, hundreds of times what such a call takes; past `PEER_START_S` plus these
the peer is stopped and named, not waited for without end."""

PEER_RESULT = {"forward_s": float, "step_s": float, "threads": int, "peak_rss_mb": float,
               "step_peak_rss_mb": float, "file_rss_mb": float, "torch_version": str,
               "fbgemm_version": str, "weights_precision": str}
"""The fields of the peer's RESULT.json that `bench step` reads, and their types."""

_SCRIPT = Path(__file__).parent / "peers" / "fbgemm_tbe.py"


class _PeerExit(NamedTuple):
    """What a peer process left: its exit status and standard error (None: timed out)."""

    returncode: int | None
    stderr: str


def _run_peer_process(argv: list[str], timeout: float, env: Mapping[str, str] | None = None
                      ) -> _PeerExit:
    """Run `argv` with `timeout` seconds; past them (or on Ctrl-C) its whole process group
    is killed, so that nothing it started holds on (a shell script's `python`, say).
    SIGTERM and SIGHUP sent to this process are passed on to that group (a session of its
    own, which a terminal's Ctrl-C does not reach). OSError if it cannot start (not
    executable, not a program)."""
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=None if env is None else dict(env), start_new_session=True)

    def forward(signum: int, _: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    try:
        with handling_signals((signal.SIGTERM, signal.SIGHUP), forward):
            _, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        return _PeerExit(None, "")
    except BaseException:
        _kill_group(child)
        raise
    return _PeerExit(child.returncode, stderr.decode(errors="replace"))


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL `child`'s process group (a session of its own), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.communicate()


def _last_line(stderr: str) -> str:
    """The last non-empty line of `stderr` (a traceback's error), or `(no output)`."""
    return (stderr.strip().splitlines() or ["(no output)"])[-1].strip()


def _exit_words(returncode: int) -> str:
    return (f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}")


def check_peer(python: Path, optimizer: str, weights_dtype: str = "float32") -> None:
    """Raise ValueError unless `python` can run the peer for `optimizer` on tables stored as
    `weights_dtype`."""
    if optimizer not in PEER_OPTIMIZERS:
        raise ValueError(f"bench step: --peer-python compares {sorted(PEER_OPTIMIZERS)} "
                         f"(FBGEMM has no exact counterpart of {optimizer!r}).")
    if weights_dtype not in PEER_WEIGHTS:
        raise ValueError(f"bench step: --peer-python compares {sorted(PEER_WEIGHTS)} tables "
                         f"(FBGEMM's CPU kernels do not train {weights_dtype} ones); drop it "
                         f"or --weights-dtype {weights_dtype}.")
    argv = [str(python), "-c", "import torch, fbgemm_gpu.split_table_batched_embeddings_ops_training"]
    try:
        probe = _run_peer_process(argv, PROBE_TIMEOUT_S)
    except OSError as error:  # not a program: a text file, another format
        raise ValueError(f"bench step: --peer-python {python}: cannot run it "
                         f"({error.strerror or error}); give a Python executable.") from None
    if probe.returncode is None:
        raise ValueError(f"bench step: --peer-python {python} did not import torch and "
                         f"fbgemm_gpu within {PROBE_TIMEOUT_S:g} s; stopped it.")
    if probe.returncode != 0:
        raise ValueError(f"bench step: --peer-python {python} cannot import torch and "
                         f"fbgemm_gpu ({_exit_words(probe.returncode)}): "
                         f"{_last_line(probe.stderr)}. Make a venv with `pip install torch "
                         "fbgemm-gpu-cpu` (versions built for each other).")


def run_peer(python: Path, features: Sequence[tc.FeatureSpec],
             batches: Sequence[Mapping[str, tc.Ragged]], optimizer: tc.OptimizerSpec,
             optimizer_name: str, timing: Mapping[str, int], seed: int,
             huge_pages: bool = False) -> dict[str, Any]:
    """FBGEMM's forward and step timings (and peak memory) on `batches`; `huge_pages`: its
    large allocations (the tables) on transparent huge pages, as tilecore's are (glibc's
    `malloc` asks for them: `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`. Torch's own
    `THP_MEM_ALLOC_ENABLE=1` measured slower: forward 4.6–5.0 ms against 2.8–2.9, and
    3.4 on 4 KiB pages, criteo26 SGD on 2 AMD vCPUs)."""
    learning_rate = getattr(optimizer, "learning_rate", 0.01)
    meta = {
        "features": [{"name": f.name, "table": f.table.name, "vocab": f.table.vocab_size,
                      "dim": f.table.embedding_dim, "combiner": f.table.combiner}
                     for f in features],
        "optimizer": PEER_OPTIMIZERS[optimizer_name],
        "weights": PEER_WEIGHTS[features[0].table.weights_dtype.name],
        "learning_rate": float(learning_rate) if not callable(learning_rate) else 0.01,
        "batches": len(batches), "seed": seed, "threads": len(os.sched_getaffinity(0)),
        **timing, "warmup": max(PEER_WARMUP, timing["warmup"]),
    }
    arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps(meta))}
    for i, batch in enumerate(batches):
        for f in features:
            if batch[f.name].weights is not None:
                raise ValueError(f"bench step: --peer-python: feature {f.name!r} is weighted; "
                                 "the peer comparison runs unit-weight workloads.")
            arrays[f"b{i}/{f.name}/values"] = np.asarray(batch[f.name].values)
            arrays[f"b{i}/{f.name}/row_splits"] = np.asarray(batch[f.name].row_splits)
    with tempfile.TemporaryDirectory(prefix="tilecore-peer-") as tmp:
        inputs, output = Path(tmp) / "batches.npz", Path(tmp) / "result.json"
        np.savez(inputs, **arrays)  # pyright: ignore[reportArgumentType]
        env = dict(os.environ)
        if huge_pages:
            tunables = [env["GLIBC_TUNABLES"]] if env.get("GLIBC_TUNABLES") else []
            env["GLIBC_TUNABLES"] = ":".join([*tunables, "glibc.malloc.hugetlb=1"])
        calls = 2 * (meta["warmup"] + meta["repeats"])  # forward calls, then step calls
        timeout = PEER_START_S + PEER_CALL_S * calls
        try:
            done = _run_peer_process([str(python), str(_SCRIPT), str(inputs), str(output)],
                                     timeout, env)
        except OSError as error:  # checked by check_peer; changed since
            raise ValueError(f"bench step: --peer-python {python}: cannot run it "
                             f"({error.strerror or error}).") from None
        if done.returncode is None:
            raise ValueError(
                f"bench step: --peer-python {python}: the FBGEMM peer did not finish within "
                f"{timeout:g} s ({PEER_START_S:g} s to start, {PEER_CALL_S:g} s for "
                f"each of its {calls} calls); stopped it.")
        if done.returncode != 0:
            raise ValueError(f"bench step: --peer-python {python}: the FBGEMM peer failed "
                             f"({_exit_words(done.returncode)}): {_last_line(done.stderr)}")
        return _peer_result(python, output)


def _peer_result(python: Path, output: Path) -> dict[str, Any]:
    """The peer's RESULT.json, checked: every field of `PEER_RESULT` of its type, the
    times finite and > 0 (tilecore's are divided by them)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"bench step: --peer-python {python}: the FBGEMM peer exited 0 but "
                          f"{why}.")

    try:
        result = json.loads(output.read_bytes())
    except FileNotFoundError:
        raise bad("wrote no result") from None
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError too
        raise bad(f"its result is not JSON ({error})") from None
    if not isinstance(result, dict):
        raise bad(f"its result is a JSON {type(result).__name__}, not an object")
    for key, kind in PEER_RESULT.items():
        value = result.get(key)
        number = kind is not str and isinstance(value, (int, float)) and not isinstance(
            value, bool)
        if not (number or (kind is str and isinstance(value, str))):
            raise bad(f"its result's {key!r} is {value!r}, not a "
                      f"{'string' if kind is str else 'number'}")
    for key in ("forward_s", "step_s"):
        if not (math.isfinite(result[key]) and result[key] > 0):
            raise bad(f"its result's {key!r} is {result[key]!r}, not a time > 0")
    return result


def copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second (read + written) of the best of `repeats` large copies where the
    tables live: a numpy copy of 256 MiB on CPU, a jitted copy of 1 GiB on the default
    accelerator (its memory system, not the host's, bounds the kernels there)."""
    import jax

    if jax.default_backend() == "cpu":
        source = np.ones(256 * 2**20 // 4, np.float32)
        target = np.empty_like(source)

        def copy() -> None:
            np.copyto(target, source)
    else:
        import jax.numpy as jnp

        source = jnp.ones(2**30 // 4, jnp.float32)
        add = jax.jit(lambda x: x + 1)  # read once, written once (x * 1 would be elided)

        def copy() -> None:
            add(source).block_until_ready()

    copy()  # compiles the accelerator's copy; touches the host's pages
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def forward_bytes(features: Sequence[tc.FeatureSpec], batches: Sequence[Mapping[str, tc.Ragged]],
                  batch_size: int) -> float:
    """Mean bytes a forward pass must move: each ID's row read once (in its table's
    `weights_dtype`), each float32 activation written once."""
    reads = np.mean([sum(len(b[f.name].values) * f.table.embedding_dim
                         * f.table.weights_dtype.itemsize for f in features) for b in batches])
    return float(reads) + 4 * batch_size * sum(f.table.embedding_dim for f in features)


def update_bytes(features: Sequence[tc.FeatureSpec], batches: Sequence[Mapping[str, tc.Ragged]],
                 batch_size: int, slots: int) -> float:
    """Mean bytes the backward pass and the fused update must move: the activations'
    gradients read once (float32), and each table row an ID touches (once per distinct
    row, as every sorted-segment update does) read and written with its `slots` float32
    slot rows. The yardstick of FBGEMM's "backward + fused optimizer" bandwidth."""
    tables: dict[str, tuple[tc.TableSpec, list[str]]] = {}
    for f in features:
        tables.setdefault(f.table.name, (f.table, []))[1].append(f.name)
    moved = []
    for b in batches:
        rows = 0.0
        for table, names in tables.values():
            touched = np.unique(np.concatenate([np.asarray(b[n].values) for n in names])).size
            rows += touched * table.embedding_dim * (table.weights_dtype.itemsize + 4 * slots)
        moved.append(2 * rows)
    return float(np.mean(moved)) + 4 * batch_size * sum(f.table.embedding_dim for f in features)
