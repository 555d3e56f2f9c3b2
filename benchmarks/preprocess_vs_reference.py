"""Host preprocessing, tilecore vs the reference `jax_tpu_embedding`, side by side.

Runs in a virtual environment that has the reference installed and tilecore
importable (see benchmarks/README.md); the reference is never a tilecore
dependency. Both sides get the same batches of a built-in `tilecore.data`
workload, have their limits calibrated the same way (one pass with dropping
allowed, then the observed maxima, so nothing is dropped), and are timed in the
same process, alternating call by call, on the same inputs.

Three timings:
  reference        embedding.preprocess_sparse_dense_matmul_input(...)
  tilecore         tilecore.preprocessing on the very same arrays (dense int32 for
                   fixed valency, object arrays of int32 arrays for ragged, and
                   float32 weights of ones)
  tilecore_native  tilecore.preprocessing on the workload's own tilecore.Ragged
                   inputs without weights (how tilecore users call it)

The reference has no thread knob: take single-thread numbers by running the whole
script under `taskset -c 0`. tilecore's thread count defaults to the CPUs this
process may run on (so `taskset -c 0` means one thread); `--threads` overrides it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np

import tilecore as tc
from tilecore import data
from tilecore_apps.bench import machine_facts

INPUT_FORMS = ("object-array", "dense")


def reference_inputs(
    workload: data.Workload, batch: Mapping[str, tc.Ragged], form: str = "object-array"
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The batch in the reference's input form, in feature order: IDs and weights of ones.

    object-array: per feature a numpy object array of per-sample int32 arrays (each its
    own array, as a data loader builds them) and float32 weights alike. dense: features
    with as many IDs in every sample as `[batch, ids]` int32 arrays (object arrays else).
    """
    ids, weights = [], []
    for feature, dist in zip(workload.features, workload.distributions, strict=True):
        ragged = batch[feature.name]
        values = ragged.values.astype(np.int32)
        if form == "dense" and dist.min_ids == dist.max_ids:
            dense = values.reshape(workload.batch_size, dist.max_ids)
            ids.append(dense)
            weights.append(np.ones(dense.shape, np.float32))
            continue
        rows = np.empty(workload.batch_size, dtype=object)
        rows[:] = [values[a:b].copy() for a, b in itertools.pairwise(ragged.row_splits)]
        ones = np.empty(workload.batch_size, dtype=object)
        ones[:] = [np.ones(len(r), np.float32) for r in rows]
        ids.append(rows)
        weights.append(ones)
    return ids, weights


def reference_features(workload: data.Workload, topology: tc.Topology) -> list[Any]:
    """The workload's specs as reference FeatureSpecs, auto-stacked and prepared for training."""
    from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

    tables = {
        name: embedding_spec.TableSpec(
            name=name, vocabulary_size=t.vocab_size, embedding_dim=t.embedding_dim,
            initializer=lambda *_: None, optimizer=embedding_spec.SGDOptimizerSpec(),
            combiner=t.combiner, max_ids_per_partition=t.max_ids_per_partition,
            max_unique_ids_per_partition=t.max_unique_ids_per_partition,
        )
        for name, t in workload.tables.items()
    }
    features = [
        embedding_spec.FeatureSpec(
            name=f.name, table_spec=tables[f.table.name], input_shape=list(f.input_shape),
            output_shape=[workload.batch_size, f.table.embedding_dim],
        )
        for f in workload.features
    ]
    g, s = topology.global_devices, topology.sc_per_device
    embedding.auto_stack_tables(features, global_device_count=g, num_sc_per_device=s)
    embedding.prepare_feature_specs_for_training(features, global_device_count=g,
                                                 num_sc_per_device=s)
    return features


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: the reference's C++ logs a line per stack per dropped batch."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Reference:
    """Calls and calibrates the reference preprocessing on one topology."""

    def __init__(self, features: list[Any], topology: tc.Topology) -> None:
        from jax_tpu_embedding.sparsecore.lib.nn import embedding

        self.embedding = embedding
        self.features = features
        self.topology = topology

    def __call__(self, ids: list[np.ndarray], weights: list[np.ndarray], *,
                 allow_id_dropping: bool = False) -> Any:
        t = self.topology
        return self.embedding.preprocess_sparse_dense_matmul_input(
            ids, weights, self.features, local_device_count=t.num_local_devices,
            global_device_count=t.global_devices, num_sc_per_device=t.sc_per_device,
            allow_id_dropping=allow_id_dropping,
        )

    def calibrate(self, inputs: Sequence[tuple[list[np.ndarray], list[np.ndarray]]]) -> Any:
        """Limits := maxima observed over `inputs` (stats merged element-wise)."""
        with quiet_stderr():
            stats = [self(ids, w, allow_id_dropping=True)[1] for ids, w in inputs]

        def merge(field: str) -> dict[str, np.ndarray]:
            maps = [getattr(s, field) for s in stats]
            return {k: reduce(np.maximum, (np.asarray(m[k]) for m in maps)) for k in maps[0]}

        merged = self.embedding.SparseDenseMatmulInputStats(
            max_ids_per_partition=merge("max_ids_per_partition"),
            max_unique_ids_per_partition=merge("max_unique_ids_per_partition"),
            required_buffer_size_per_sc=merge("required_buffer_size_per_sc"),
        )
        self.embedding.update_preprocessing_parameters(
            self.features, merged, num_sc_per_device=self.topology.sc_per_device
        )
        return merged

    def limits(self) -> dict[str, tuple[int, int]]:
        """Per stack: (max_ids_per_partition, max_unique_ids_per_partition)."""
        out = {}
        for f in self.features:
            s = f.table_spec.stacked_table_spec
            out[s.stack_name] = (s.max_ids_per_partition, s.max_unique_ids_per_partition)
        return out


def calibrate_tilecore(
    plan: tc.StackingPlan, batches: Sequence[Mapping[str, tc.Ragged]], threads: int
) -> tuple[tc.StackingPlan, tc.PreprocessStats]:
    """Limits := maxima observed over `batches` (one pass with dropping allowed)."""
    dropping = plan.with_config(allow_id_dropping=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tc.IdDroppingWarning)
        stats = [tc.preprocess(dropping, b, num_threads=threads)[1] for b in batches]
    merged = reduce(tc.PreprocessStats.merge, stats)
    return tc.update_preprocessing_parameters(plan, merged), merged


def summary(seconds: list[float], ids: list[int]) -> dict[str, float]:
    rates = [n / t for n, t in zip(ids, seconds, strict=True)]
    return {"median_s": statistics.median(seconds), "min_s": min(seconds),
            "max_s": max(seconds), "ids_per_s": statistics.median(rates)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workload", default="criteo", choices=sorted(data.WORKLOADS))
    p.add_argument("--topology", default="1x4", help="LxS: L devices x S SparseCores")
    p.add_argument("--threads", type=int, default=None,
                   help="tilecore threads (default: CPUs in this process's affinity mask)")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--input-form", default="object-array", choices=INPUT_FORMS,
                   help="the reference's input form both sides get (default object-array)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--matrix", action="store_true",
                   help="run every --workloads x --cpu-sets pair in its own process pinned "
                        "with taskset, --rounds times interleaved, and summarise the medians")
    p.add_argument("--workloads", nargs="+", default=["criteo", "multihot"])
    p.add_argument("--cpu-sets", nargs="+", default=["0", "0,1"],
                   help="taskset CPU lists (tilecore threads = CPUs in the set)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.matrix:
        return matrix(args)

    devices, sc = (int(x) for x in args.topology.lower().split("x"))
    topology = tc.Topology(global_devices=devices, sc_per_device=sc)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or cpus or 1
    sizes = {} if args.batch_size is None else {"batch_size": args.batch_size}
    workload = data.get_workload(args.workload, seed=args.seed, **sizes)

    batches = [workload.batch(step, num_threads=threads) for step in range(args.batches)]
    ids = [data.num_ids(b) for b in batches]
    ref_inputs = [reference_inputs(workload, b, args.input_form) for b in batches]

    reference = Reference(reference_features(workload, topology), topology)
    ref_stats = reference.calibrate(ref_inputs)
    plan = tc.plan_stacking(workload.features, topology)
    plan, tc_stats = calibrate_tilecore(plan, batches, threads)
    tc_limits = {n: (s.max_ids_per_partition, s.max_unique_ids_per_partition)
                 for n, s in plan.stacks.items()}
    stats_match = set(ref_stats.max_ids_per_partition) == set(tc_stats.max_ids_per_partition) and all(
        np.array_equal(np.asarray(ref_stats.max_ids_per_partition[k]).reshape(-1),
                       tc_stats.max_ids_per_partition[k].reshape(-1))
        and np.array_equal(np.asarray(ref_stats.max_unique_ids_per_partition[k]).reshape(-1),
                           tc_stats.max_unique_ids_per_partition[k].reshape(-1))
        for k in tc_stats.max_ids_per_partition
    )

    calls: dict[str, Callable[[int], Any]] = {
        "reference": lambda i: reference(*ref_inputs[i]),
        "tilecore": lambda i: tc.preprocess(
            plan, dict(zip((f.name for f in workload.features), ref_inputs[i][0], strict=True)),
            dict(zip((f.name for f in workload.features), ref_inputs[i][1], strict=True)),
            num_threads=threads,
        ),
        "tilecore_native": lambda i: tc.preprocess(plan, batches[i], num_threads=threads),
    }
    for name, call in calls.items():  # nothing may be dropped after calibration
        stats = call(0)[1]
        dropped = (sum(stats.id_drop_counters.values()) if name == "reference"
                   else stats.dropped_ids)
        if dropped:
            raise RuntimeError(f"{name} dropped {dropped} IDs after calibration.")
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    timed_ids: list[int] = []
    for r in range(args.warmup + args.repeats):
        i = r % len(batches)
        for name, call in calls.items():  # alternate, so drift hits all sides alike
            t0 = time.perf_counter()
            call(i)
            if r >= args.warmup:
                seconds[name].append(time.perf_counter() - t0)
        if r >= args.warmup:
            timed_ids.append(ids[i])

    results = {name: summary(s, timed_ids) for name, s in seconds.items()}
    ref_rate = results["reference"]["ids_per_s"]
    report = {
        "workload": args.workload, "input_form": args.input_form, "topology": str(topology),
        "batch_size": workload.batch_size,
        "tilecore_threads": threads, "cpus_allowed": cpus, "batches": args.batches,
        "warmup": args.warmup, "repeats": args.repeats,
        "ids_per_batch": float(np.mean(ids)),
        **results,
        "speedup": results["tilecore"]["ids_per_s"] / ref_rate,
        "speedup_native": results["tilecore_native"]["ids_per_s"] / ref_rate,
        "stacks_match": set(reference.limits()) == set(tc_limits),
        "limits_match": reference.limits() == tc_limits,
        "stats_match": bool(stats_match),
        **machine_facts(), "numpy": np.__version__,
        "tilecore_version": tc.__version__,
    }
    print(f"{args.workload} {args.input_form} {topology} threads={threads} (cpus allowed {cpus}): "
          f"{report['ids_per_batch'] / 1e6:.2f} M IDs/batch")
    for name, r in results.items():
        print(f"  {name:16s} median {r['median_s'] * 1e3:8.2f} ms  {r['ids_per_s'] / 1e6:7.1f} M IDs/s")
    print(f"  speedup {report['speedup']:.2f}x (same inputs), {report['speedup_native']:.2f}x "
          f"(native inputs); stacks match: {report['stacks_match']}, limits match: "
          f"{report['limits_match']}, stats match: {report['stats_match']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def matrix(args: argparse.Namespace) -> dict[str, Any]:
    """Each (workload, CPU set) in a fresh process under `taskset`, round-robin over
    `args.rounds` rounds (so load from other users hits every pair alike); per pair the
    median over rounds of each run's medians, and the spread of the speedups."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for workload in args.workloads:
                for cpus in args.cpu_sets:
                    out = Path(tmp) / f"{workload}-{cpus}-{r}.json"
                    subprocess.run(
                        ["taskset", "-c", cpus, sys.executable, __file__, "--workload", workload,
                         "--input-form", args.input_form, "--topology", args.topology,
                         "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                         "--batches", str(args.batches), "--json", str(out)],
                        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    runs.setdefault((workload, cpus), []).append(json.loads(out.read_text()))
    rows = []
    for (workload, cpus), reports in runs.items():
        speedups = [x["speedup"] for x in reports]
        ms = {name: statistics.median(x[name]["median_s"] for x in reports) * 1e3
              for name in ("reference", "tilecore", "tilecore_native")}
        rows.append({"workload": workload, "input_form": args.input_form, "cpus": cpus,
                     "threads": reports[0]["tilecore_threads"], "rounds": len(reports),
                     **{f"{name}_ms": v for name, v in ms.items()},
                     "speedup": statistics.median(speedups), "speedup_min": min(speedups),
                     "speedup_max": max(speedups),
                     "speedup_native": statistics.median(x["speedup_native"] for x in reports),
                     "stats_match": all(x["stats_match"] for x in reports)})
    print(f"{'workload':10s} {'threads':>7s} {'reference':>10s} {'tilecore':>10s} "
          f"{'native':>10s} {'speedup (min-max over rounds)':>30s}")
    for x in rows:
        print(f"{x['workload']:10s} {x['threads']:7d} {x['reference_ms']:8.1f}ms "
              f"{x['tilecore_ms']:8.1f}ms {x['tilecore_native_ms']:8.1f}ms "
              f"{x['speedup']:12.2f}x ({x['speedup_min']:.2f}-{x['speedup_max']:.2f})")
    summary = {"rounds": args.rounds, "repeats": args.repeats, "pairs": rows,
               **machine_facts()}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
