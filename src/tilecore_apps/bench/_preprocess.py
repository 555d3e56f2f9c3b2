"""`tilecore bench preprocess`: time host preprocessing on a built-in workload (and, with
`--device`, device preprocessing beside it on the same batches)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

import tilecore as tc
from tilecore import data

from .._common import (
    add_threads_option,
    add_workload_option,
    calibrate,
    effective_threads,
    parse_topology,
    write_json,
)
from .._fits import check_batches
from .._options import output_file, positive_int, seed_int
from ._machine import machine_facts
from ._memory import PeakProbe


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "preprocess",
        help="time tc.preprocess on a workload",
        description=(
            "Pre-generate --batches batches of a workload, calibrate the limits from their "
            "statistics (so nothing is dropped), then time --repeats preprocessing calls "
            "(cycling over the batches) after --warmup untimed calls. Generation is not timed."
        ),
    )
    add_workload_option(p)
    p.add_argument("--topology", default="1x4", metavar="LxS",
                   help="L devices x S SparseCores (default 1x4)")
    add_threads_option(p)
    p.add_argument("--repeats", type=int, default=10, help="timed calls (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    p.add_argument("--batches", type=int, default=3, help="distinct batches (default 3)")
    p.add_argument("--seed", type=seed_int, default=0, help="workload seed (default 0)")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="write results here")
    p.add_argument(
        "--minibatching", choices=("off", "on", "forced"), default="off",
        help="off: no minibatching (default); on: enable_minibatching with the calibrated "
             "limits (never triggered); forced: limits halved after calibration so every "
             "batch is split (dropping allowed for rows one bucket cannot hold, buffers "
             "doubled for the extra alignment)",
    )
    p.add_argument(
        "--input-form", choices=INPUT_FORMS, default="ragged",
        help="ragged: tilecore.Ragged, no weights (default); object-array: the reference's "
             "form, per feature a numpy object array of per-sample int32 arrays with float32 "
             "weights of one alike; dense: [batch, ids] int32 arrays and float32 weights of "
             "one where every sample has as many IDs (object arrays elsewhere)",
    )
    p.add_argument(
        "--device", action="store_true",
        help="also time tilecore.ops.preprocess_on_device on the same batches (compiled "
             "during its warm-up, each output checked bit-identical to the host's; needs "
             "--minibatching off); the JSON gains a 'device' section")
    p.add_argument("--batch-size", type=positive_int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(run=run)


INPUT_FORMS = ("ragged", "object-array", "dense")
Inputs = tuple[dict[str, Any], dict[str, Any] | None]


def input_form(workload: data.Workload, batch: dict[str, tc.Ragged], form: str) -> Inputs:
    """One batch as (IDs, weights) in `form` (one of `INPUT_FORMS`), IDs as int32."""
    if form == "ragged":
        return dict(batch), None
    ids: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    for feature, dist in zip(workload.features, workload.distributions, strict=True):
        ragged = batch[feature.name]
        values = ragged.values.astype(np.int32)
        if form == "dense" and dist.min_ids == dist.max_ids:
            ids[feature.name] = values.reshape(workload.batch_size, dist.max_ids)
            weights[feature.name] = np.ones(ids[feature.name].shape, np.float32)
            continue
        rows = np.empty(len(ragged.row_splits) - 1, dtype=object)
        rows[:] = [values[a:b].copy() for a, b in itertools.pairwise(ragged.row_splits)]
        ones = np.empty(len(rows), dtype=object)
        ones[:] = [np.ones(len(r), np.float32) for r in rows]
        ids[feature.name], weights[feature.name] = rows, ones
    return ids, weights


def _positive(parser_name: str, **values: int) -> None:
    """Raise ValueError naming the first flag below its least value: 0 for --warmup (no
    untimed call is fine: nothing compiles), 1 for the others."""
    for name, value in values.items():
        least = 0 if name == "warmup" else 1
        if value < least:
            raise ValueError(f"{parser_name}: --{name} must be >= {least}, got {value}.")


def _check(args: argparse.Namespace) -> None:
    _positive("bench preprocess", repeats=args.repeats, warmup=args.warmup, batches=args.batches)
    if args.device and args.minibatching != "off":
        raise ValueError("bench preprocess: --device needs --minibatching off (device "
                         "preprocessing does not minibatch).")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"bench preprocess: --threads must be >= 1, got {args.threads}.")


def _preprocess_call(plan: tc.StackingPlan, inputs: list[Inputs], args: argparse.Namespace,
                     num_minibatches: list[int]) -> Callable[[int], tc.PreprocessedBatch]:
    """The timed call: `preprocess` of batch `i` (cycling), each one's minibatch count
    appended to `num_minibatches`; a dropped ID (impossible once calibrated on these
    batches, unless `--minibatching forced`) raises."""
    def call(i: int) -> tc.PreprocessedBatch:
        out, stats = tc.preprocess(plan, *inputs[i % len(inputs)], num_threads=args.threads)
        num_minibatches.append(out.num_minibatches)
        if stats.dropped_ids and args.minibatching != "forced":
            raise RuntimeError(f"bench dropped {stats.dropped_ids} IDs after calibration.")
        return out

    return call


def _time_calls(call: Callable[[int], tc.PreprocessedBatch], ids: list[int], warmup: int,
                repeats: int) -> tuple[list[float], list[float], int]:
    """Seconds and IDs/s of each of `repeats` calls after `warmup` untimed ones, and the
    largest output's bytes (each output dropped before the next call)."""
    for i in range(warmup):
        call(i)
    seconds, rates, output_bytes = [], [], 0
    for i in range(repeats):
        t0 = time.perf_counter()
        out = call(i)
        dt = time.perf_counter() - t0
        seconds.append(dt)
        rates.append(ids[i % len(ids)] / dt)
        output_bytes = max(output_bytes, _nbytes(out))
        del out
    return seconds, rates, output_bytes


def run(args: argparse.Namespace) -> int:
    _check(args)
    topology = parse_topology(args.topology)
    sizes = {} if args.batch_size is None else {"batch_size": args.batch_size}
    workload = data.get_workload(args.workload, seed=args.seed, **sizes)
    check_batches(workload, args.batches, "--batches")  # all drawn before any is timed
    plan = tc.plan_stacking(workload.features, topology)

    threads = effective_threads(args.threads)
    batches, generation_s = _draw(workload, args.batches, threads)
    ids = [data.num_ids(b) for b in batches]
    inputs = [input_form(workload, b, args.input_form) for b in batches]
    _load_kernels(args.workload, topology, args.threads, args.input_form)

    probe = PeakProbe.start()  # from here on: calibration, warm-up and timed calls
    plan, _ = calibrate(plan, batches, num_threads=args.threads)
    plan = _with_minibatching(plan, args.minibatching)
    num_minibatches: list[int] = []
    call = _preprocess_call(plan, inputs, args, num_minibatches)
    seconds, rates, output_bytes = _time_calls(call, ids, args.warmup, args.repeats)
    peak_extra = probe.extra_bytes()

    result = {
        "workload": args.workload,
        "topology": str(topology),
        "threads": threads,
        "batch_size": workload.batch_size,
        "seed": args.seed,
        "stacks": len(plan.stacks),
        "minibatching": args.minibatching,
        "input_form": args.input_form,
        "num_minibatches_median": statistics.median(num_minibatches),
        "batches": args.batches,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "ids_per_batch": float(np.mean(ids)),
        "ids_per_s": statistics.median(rates),
        "generation_s_per_batch": generation_s,
        "output_bytes": output_bytes,
        "peak_extra_bytes": peak_extra,
        "peak_extra_method": probe.method,
        "peak_extra_over_output": peak_extra / output_bytes if output_bytes else None,
        "tilecore_version": tc.__version__,
        "numpy_version": np.__version__,
        **machine_facts(),
    }
    if args.device:
        result["device"] = _time_device(plan, inputs, ids, args.warmup, args.repeats)
    _print(result)
    if args.json is not None:
        write_json(args.json, result)
    return 0


def _draw(workload: Any, count: int, threads: int) -> tuple[list[Any], float]:
    """The workload's first `count` batches (its generator compiled first), and the seconds
    each took to draw."""
    workload.warm_up()
    t0 = time.perf_counter()
    batches = [workload.batch(step, num_threads=threads) for step in range(count)]
    return batches, (time.perf_counter() - t0) / count


def _time_device(plan: tc.StackingPlan, inputs: list[Inputs], ids: list[int], warmup: int,
                 repeats: int) -> dict[str, Any]:
    """`preprocess_on_device` on the batches the host path was timed on: seconds per call
    (until its buffers are ready), of which the host's flattening, and the first call's
    (compiling). Each batch is checked bit-identical to the host's first."""
    import jax

    from tilecore import ops
    from tilecore.preprocessing import flatten

    def call(i: int) -> tc.PreprocessedBatch:
        out, _ = ops.preprocess_on_device(plan, *inputs[i % len(inputs)])
        return jax.block_until_ready(out)

    t0 = time.perf_counter()
    call(0)
    first_s = time.perf_counter() - t0
    for i, (ids_i, weights_i) in enumerate(inputs):
        host, _ = tc.preprocess(plan, ids_i, weights_i)
        device = call(i)
        for name, b in host.stacks.items():
            for field in (f.name for f in dataclasses.fields(tc.StackBuffers)):
                if np.asarray(getattr(device.stacks[name], field)).tobytes() != getattr(
                        b, field).tobytes():
                    raise RuntimeError(f"bench: the device's {name}.{field} of batch {i} "
                                       "differs from the host's.")
    for i in range(warmup):
        call(i)
    seconds, flatten_s, rates = [], [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        flatten(plan, *inputs[i % len(inputs)])
        flatten_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        call(i)
        seconds.append(time.perf_counter() - t0)
        rates.append(ids[i % len(ids)] / seconds[-1])
    device = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "first_call_s": first_s,
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "ids_per_s": statistics.median(rates),
        "host_flatten_median_s": statistics.median(flatten_s),
        "bit_identical": True,
        "jax_version": jax.__version__,
    }


def _with_minibatching(plan: tc.StackingPlan, mode: str) -> tc.StackingPlan:
    if mode == "off":
        return plan
    if mode == "on":
        return plan.with_config(enable_minibatching=True)
    for name, stack in plan.stacks.items():
        suggested = stack.suggested_coo_buffer_size_per_device
        plan = plan.with_stack_limits(
            name, max_ids_per_partition=max(1, stack.max_ids_per_partition // 2),
            max_unique_ids_per_partition=max(1, stack.max_unique_ids_per_partition // 2),
            suggested_coo_buffer_size_per_device=None if suggested is None else 2 * suggested,
        )
    return plan.with_config(enable_minibatching=True, allow_id_dropping=True)


def _nbytes(batch: tc.PreprocessedBatch) -> int:
    return sum(
        a.nbytes for s in batch.stacks.values()
        for a in (s.row_pointers, s.embedding_ids, s.sample_ids, s.gains)
    )


def _load_kernels(workload: str, topology: tc.Topology, threads: int | None, form: str) -> None:
    """Compile (or load from numba's cache) the kernels on a tiny batch, outside the probes."""
    tiny = data.get_workload(workload, batch_size=8 * topology.num_partitions)
    plan = tc.plan_stacking(tiny.features, topology)
    ids, weights = input_form(tiny, tiny.batch(0), form)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tc.IdDroppingWarning)
        tc.preprocess(plan.with_config(allow_id_dropping=True), ids, weights, num_threads=threads)


def _print(r: dict[str, Any]) -> None:
    mib = 1024 * 1024
    print(
        f"bench preprocess: workload={r['workload']} topology={r['topology']} "
        f"threads={r['threads']} batch={r['batch_size']} stacks={r['stacks']} "
        f"input={r['input_form']}\n"
        f"  {r['ids_per_batch'] / 1e6:.3f} M IDs/batch, {r['repeats']} timed calls after "
        f"{r['warmup']} warm-up, over {r['batches']} batches\n"
        f"  seconds/batch  median {r['median_s'] * 1e3:.2f} ms   min {r['min_s'] * 1e3:.2f} ms"
        f"   max {r['max_s'] * 1e3:.2f} ms\n"
        f"  throughput     {r['ids_per_s'] / 1e6:.1f} M IDs/s   "
        f"({1 / r['median_s']:.1f} batches/s)\n"
        f"  memory         output {r['output_bytes'] / mib:.1f} MiB per batch; peak extra "
        f"{r['peak_extra_bytes'] / mib:.1f} MiB ({r['peak_extra_over_output']:.2f}x output, "
        f"{r['peak_extra_method']})\n"
        f"  generation     {r['generation_s_per_batch'] * 1e3:.1f} ms/batch (not timed)",
        file=sys.stdout,
    )
    d = r.get("device")
    if d is not None:
        print(
            f"  device ({d['backend']}, {d['device_kind']}): median {d['median_s'] * 1e3:.2f} ms"
            f"/batch, {d['ids_per_s'] / 1e6:.1f} M IDs/s ({r['median_s'] / d['median_s']:.2f}x "
            f"the host's speed), of which host flattening {d['host_flatten_median_s'] * 1e3:.2f}"
            f" ms; first call {d['first_call_s']:.2f} s (compiling); bit-identical",
            file=sys.stdout,
        )
