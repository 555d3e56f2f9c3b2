"""`tilecore demo`: plan, calibrate and preprocess a built-in workload; print what it took."""

from __future__ import annotations

import argparse
import time
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
    preprocess_dropping,
)
from .._options import positive_int, seed_int


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="preprocess a built-in workload and print per-stack statistics",
        description=(
            "Build the stacking plan of a built-in workload, calibrate its limits on the first "
            "batch, preprocess --steps more batches (IDs over the limits are dropped and "
            "counted) and print per-stack statistics and the throughput."
        ),
    )
    add_workload_option(p)
    p.add_argument("--topology", default="1x4", metavar="LxS",
                   help="L devices x S SparseCores (default 1x4)")
    p.add_argument("--steps", type=int, default=5, help="batches after calibration (default 5)")
    add_threads_option(p)
    p.add_argument("--headroom", type=float, default=0.1,
                   help="calibrated limits = observed maxima x (1 + headroom) (default 0.1)")
    p.add_argument("--seed", type=seed_int, default=0, help="workload seed (default 0)")
    p.add_argument("--batch-size", type=positive_int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}.")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}.")
    topology = parse_topology(args.topology)
    sizes = {} if args.batch_size is None else {"batch_size": args.batch_size}
    workload = data.get_workload(args.workload, seed=args.seed, **sizes)
    plan = tc.plan_stacking(workload.features, topology)
    threads = effective_threads(args.threads)
    print(
        f"workload {workload.name}: {len(workload.features)} features on "
        f"{len(workload.tables)} tables, batch {workload.batch_size}; topology {topology} "
        f"(N={topology.num_partitions} partitions) → {len(plan.stacks)} stacks; "
        f"threads {threads}"
    )

    t0 = time.perf_counter()
    first = workload.batch(0, num_threads=threads)
    plan, _ = calibrate(plan, [first], num_threads=args.threads, headroom=args.headroom)
    print(f"calibrated limits on batch 0 (+{args.headroom:.0%} headroom) in "
          f"{time.perf_counter() - t0:.2f} s, including compiling the kernels on first use")

    stats: tc.PreprocessStats | None = None
    seconds, ids, gen_seconds = 0.0, 0, 0.0
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch = workload.batch(step, num_threads=threads)
        t1 = time.perf_counter()
        _, step_stats = preprocess_dropping(plan, batch, num_threads=args.threads)
        seconds += time.perf_counter() - t1
        gen_seconds += t1 - t0
        ids += data.num_ids(batch)
        stats = step_stats if stats is None else stats.merge(step_stats)
    assert stats is not None
    print(format_table(plan, stats))
    print(
        f"preprocessed {args.steps} batch{'' if args.steps == 1 else 'es'} "
        f"({ids / args.steps / 1e6:.2f} M IDs each) in "
        f"{seconds:.3f} s: {ids / seconds / 1e6:.1f} M IDs/s, {args.steps / seconds:.1f} batches/s "
        f"(generating them took {gen_seconds:.3f} s, not counted)"
    )
    if stats.dropped_ids:
        print(f"{stats.dropped_ids} IDs exceeded the limits calibrated on batch 0 and were "
              "dropped; calibrate on more batches or raise --headroom to keep them.")
    return 0


def _tables(names: tuple[str, ...], width: int = 24) -> str:
    text = ",".join(names)
    return text if len(text) <= width else f"{names[0]}…{names[-1]} ({len(names)})"


def format_table(plan: tc.StackingPlan, stats: tc.PreprocessStats) -> str:
    """One line per stack: tables, limits vs observed maxima, buffer per SparseCore, drops."""
    header = ("stack", "tables", "ids/part", "limit", "uniq/part", "limit", "buf/SC", "dropped")
    rows: list[tuple[str, ...]] = [header]
    for name, stack in plan.stacks.items():
        short = name if len(name) <= 18 else name[:17] + "…"
        rows.append((
            short,
            _tables(stack.table_names),
            str(int(np.max(stats.max_ids_per_partition[name]))),
            str(stack.max_ids_per_partition),
            str(int(np.max(stats.max_unique_ids_per_partition[name]))),
            str(stack.max_unique_ids_per_partition),
            str(int(np.max(stats.required_buffer_size_per_sc[name]))),
            str(stats.id_drop_counters[name]),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        cells = [
            c.ljust(w) if j < 2 else c.rjust(w)
            for j, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
