"""`tilecore bench step --peer-python`: the same batches through FBGEMM, in the same run.

The peer runs in its own Python (`peers/fbgemm_tbe.py` beside this module, a script
that imports torch and fbgemm-gpu-cpu, never tilecore), on the IDs tilecore's step
saw; this module writes them out, runs it, and reads its timings back. Also here:
the copy bandwidth where the tables live, and the bytes a forward pass and an update
must move: the yardsticks of their bytes per second.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import tilecore as tc

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

_SCRIPT = Path(__file__).parent / "peers" / "fbgemm_tbe.py"


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
    probe = subprocess.run(
        [str(python), "-c", "import torch, fbgemm_gpu.split_table_batched_embeddings_ops_training"],
        capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"bench step: --peer-python {python} cannot import torch and "
                         f"fbgemm_gpu: {last}. Make a venv with `pip install torch "
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
        done = subprocess.run([str(python), str(_SCRIPT), str(inputs), str(output)],
                              capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"bench step: the FBGEMM peer failed (exit {done.returncode}):\n"
                               f"{tail}")
        return json.loads(output.read_text())


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
