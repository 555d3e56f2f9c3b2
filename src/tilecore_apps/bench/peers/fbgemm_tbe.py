# pyright: reportMissingImports=false
"""The peer side of `tilecore bench step --peer-python`: FBGEMM's table-batched embeddings.

Run as a script by another Python (one with `torch` and `fbgemm-gpu-cpu`, never a
tilecore dependency); it imports neither tilecore nor JAX:

    PYTHON fbgemm_tbe.py BATCHES.npz RESULT.json

`BATCHES.npz` holds `meta` (JSON: features with their table, vocabulary, width
and combiner; optimizer and learning rate; the tables' storage `weights`, fp32 or
fp16; warm-up, repeats, threads) and per batch `i` and feature `f` the arrays
`b<i>/<f>/values` and `b<i>/<f>/row_splits`: the same IDs tilecore's step sees. The
step mirrors tilecore's: forward through one `SplitTableBatchedEmbeddingBagsCodegen`
holding every table, the same dense loss (`0.5·mean_b‖Σ_f act_f·W_f‖²`), backward
with the optimizer fused (exact, on the touched rows; half tables rounded
stochastically). Times are medians of `repeats` calls after `warmup` ones of the
forward and then of the step; `peak_rss_mb` is the process's peak resident memory,
`step_peak_rss_mb` its peak during the timed calls (the high-water mark is reset once
the tables and batches are built and the warm-up calls ran, as tilecore's side does),
`file_rss_mb` the part of the resident set that maps files (torch's and FBGEMM's code).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np


def _median_seconds(call, warmup: int, repeats: int) -> float:
    for i in range(warmup):
        call(i)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        call(warmup + i)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _status_mb(field: str) -> float:
    """A field of /proc/self/status in MB (NaN if absent)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from
    the parent that started it)."""
    return _status_mb("VmHWM")


def _reset_peak_rss() -> None:
    """VmHWM := the current resident set (Linux: writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def main(batches_path: str, result_path: str) -> None:
    import torch

    archive = np.load(batches_path)
    meta = json.loads(str(archive["meta"]))
    torch.set_num_threads(int(meta["threads"]))
    features = meta["features"]
    embedding = _embedding(meta, features)
    inputs = _inputs(archive, int(meta["batches"]), features)
    rng = np.random.default_rng(int(meta["seed"]))
    projection = torch.from_numpy(np.concatenate([
        rng.standard_normal((int(f["dim"]), 8)) / np.sqrt(int(f["dim"])) for f in features
    ]).astype(np.float32))
    n = len(inputs)

    def forward(i: int) -> None:
        with torch.no_grad():
            embedding(*inputs[i % n])

    def step(i: int) -> None:
        pooled = embedding(*inputs[i % n])
        z = pooled @ projection
        (0.5 * (z * z).sum(dim=-1).mean()).backward()

    warmup, repeats = int(meta["warmup"]), int(meta["repeats"])
    for call in (forward, step):  # FBGEMM's own first-call set-up, as tilecore's compiles
        for i in range(warmup):
            call(i)
    peak_rss_mb = _peak_rss_mb()  # set-up: the tables (initialised in place), batches, warm-up
    _reset_peak_rss()
    forward_s = _median_seconds(lambda i: forward(warmup + i), 0, repeats)
    step_s = _median_seconds(lambda i: step(warmup + i), 0, repeats)
    step_peak_rss_mb = _peak_rss_mb()
    file_rss_mb = _status_mb("RssFile")
    import fbgemm_gpu

    result = {
        "forward_s": forward_s, "step_s": step_s, "threads": torch.get_num_threads(),
        "peak_rss_mb": max(peak_rss_mb, step_peak_rss_mb), "step_peak_rss_mb": step_peak_rss_mb,
        "file_rss_mb": file_rss_mb,
        "torch_version": torch.__version__,
        "fbgemm_version": getattr(fbgemm_gpu, "__version__", "unknown"),
        "optimizer": str(embedding.optimizer),
        "weights_precision": str(embedding.weights_precision),
    }
    with open(result_path, "w") as out:
        json.dump(result, out)


def _embedding(meta: dict[str, Any], features: list[dict[str, Any]]) -> Any:
    """FBGEMM's table-batched embeddings of the run's tables on the CPU, with its fused
    optimizer (exact SGD or Adagrad) and pooling (sum or mean)."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tables = list(dict.fromkeys(f["table"] for f in features))
    vocab = {f["table"]: int(f["vocab"]) for f in features}
    dim = {f["table"]: int(f["dim"]) for f in features}
    combiners = {f["combiner"] for f in features}
    if len(combiners) != 1 or combiners - {"sum", "mean"}:
        raise SystemExit(f"FBGEMM peer: one combiner, sum or mean, per run; got {combiners}")
    optimizer = {"sgd": EmbOptimType.EXACT_SGD,
                 "adagrad": EmbOptimType.EXACT_ADAGRAD}[meta["optimizer"]]
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(vocab[t], dim[t], EmbeddingLocation.HOST, ComputeDevice.CPU)
                         for t in tables],
        feature_table_map=[tables.index(f["table"]) for f in features],
        optimizer=optimizer, learning_rate=float(meta["learning_rate"]), eps=1e-8,
        pooling_mode=PoolingMode.SUM if combiners == {"sum"} else PoolingMode.MEAN,
        bounds_check_mode=BoundsCheckMode.NONE,  # tilecore's device ops do not range-check
        weights_precision={"fp32": SparseType.FP32, "fp16": SparseType.FP16}[
            meta.get("weights", "fp32")],
        stochastic_rounding=True,  # as tilecore's half tables
        device=torch.device("cpu"),
    )


def _inputs(archive: Any, batches: int, features: list[dict[str, Any]]
            ) -> list[tuple[Any, Any]]:
    """Each batch as FBGEMM takes it: every feature's IDs back to back and the bags'
    offsets into them (int64 tensors)."""
    import torch

    inputs = []
    for i in range(batches):
        values = [archive[f"b{i}/{f['name']}/values"].astype(np.int64) for f in features]
        splits = [archive[f"b{i}/{f['name']}/row_splits"].astype(np.int64) for f in features]
        starts = np.cumsum([0] + [len(v) for v in values[:-1]])
        offsets = np.concatenate([s[:-1] + o for s, o in zip(splits, starts, strict=True)]
                                 + [[starts[-1] + len(values[-1])]])
        inputs.append((torch.from_numpy(np.concatenate(values)), torch.from_numpy(offsets)))
    return inputs


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
