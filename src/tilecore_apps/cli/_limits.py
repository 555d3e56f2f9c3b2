"""`tilecore limits`: observed vs current vs recommended limits per stack, per topology."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import numpy as np

import tilecore as tc
from tilecore import data

from .._common import topology_arg, write_file, write_json
from .._fits import check_batches
from .._options import int_list, output_file, positive_int, seed_int
from ._data import add_read_options, check_read_options, open_data
from ._limits_scan import report, scan

Batches = Callable[[], Iterator[Mapping[str, tc.Ragged]]]
EMBEDDING_DIM = 16  # of tables made for --data features (tilecore train's default)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "limits",
        help="observed and recommended preprocessing limits per stack",
        description=(
            "Scan batches (a built-in workload, or --data: click data as `tilecore train "
            "--data` reads it, or one .npz batch file) under each "
            "--topology's default plan and report per stack: the observed maxima of IDs and "
            "unique IDs per partition (max over batches), the current and recommended limits "
            "(recommended = observed maxima; COO buffer = largest per-SparseCore need x S), the "
            "HBM-stack estimates, the padding overhead, an ESTIMATE of the minibatches the "
            "current limits would need (the power of two covering observed/limit; training "
            "with minibatching reports the actual counts) and the IDs the current limits "
            "would drop with dropping allowed."
        ),
    )
    p.add_argument("--workload", default=None, choices=sorted(data.WORKLOADS),
                   help="built-in workload (default criteo); with --data, the file is one "
                        "batch of this workload's features")
    p.add_argument("--topology", nargs="+", action="extend", type=topology_arg, default=None,
                   metavar="LxS",
                   help="one or more topologies, L devices x S SparseCores (default 1x4)")
    p.add_argument("--batches", type=positive_int, default=8, help="batches to scan (default 8)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="samples per batch (default: the workload's, or --data's rows)")
    p.add_argument("--seed", type=seed_int, default=0, help="workload seed (default 0)")
    p.add_argument("--data", type=Path, default=None, metavar="PATH",
                   help="scan --batches batches of this click data (what `train --data` "
                        "reads: Criteo TSV, Parquet, a directory of .npz click files; one table "
                        f"of width {EMBEDDING_DIM} per sparse feature), or the one batch of a "
                        ".npz file (arrays <feature>/values, <feature>/row_splits, optional "
                        "<feature>/weights; a table per feature, vocabulary from its IDs). With "
                        "--workload, a .npz or .parquet (a list<int> column per feature) batch "
                        "of that workload's features")
    p.add_argument("--vocab-sizes", type=int_list, default=None, metavar="V1,V2,...",
                   help="TSV or Parquet --data: vocabulary of each sparse feature, or one for "
                        f"all (default: the Parquet schema, else {data.DEFAULT_VOCAB_SIZE})")
    add_read_options(p, eval_data=False)
    p.add_argument("--plot", type=output_file, default=None, metavar="PATH.png",
                   help="write a PNG of per-partition load (max, mean) per stack")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="write the numbers")
    p.set_defaults(run=run)


def _data_batch(args: argparse.Namespace
                ) -> tuple[tuple[tc.FeatureSpec, ...], int, dict[str, tc.Ragged]]:
    """The one batch of a batch file `--data`, its feature specs and batch size."""
    try:
        batch = data.load_batch(args.data)
    except (OSError, ValueError) as error:
        raise ValueError(f"--data {error}") from None
    rows = {f: r.num_rows for f, r in batch.items()}
    size = args.batch_size if args.batch_size is not None else max(rows.values(), default=0)
    features = None
    if args.workload is not None:
        features = data.get_workload(args.workload, seed=args.seed, batch_size=size).features
        names = {f.name for f in features}
        missing, unknown = sorted(names - batch.keys()), sorted(batch.keys() - names)
        if missing or unknown:
            raise ValueError(f"--data {args.data}: its features do not match workload "
                             f"{args.workload!r}: missing {missing}, unknown {unknown}.")
    wrong = {f: n for f, n in rows.items() if n != size}
    if wrong:
        raise ValueError(f"--data {args.data}: every feature needs {size} rows (the batch "
                         f"size); got {wrong}. Pass --batch-size or fix the row_splits.")
    if features is None:  # a table per feature, as large as its IDs need
        features = data.click_feature_specs(
            [data.ClickFeature(name=f, vocab_size=int(r.values.max(initial=0)) + 1,
                               max_ids=max(int(np.diff(r.row_splits).max(initial=1)), 1))
             for f, r in batch.items()], size, embedding_dim=EMBEDDING_DIM)
    return features, size, batch


class _Scanned(NamedTuple):
    """What `limits` scans: its name, batch size, feature specs, number of batches, batches, and
    the click source it reads them from (None for a workload or one batch file)."""

    name: str
    batch_size: int
    features: tuple[tc.FeatureSpec, ...]
    num_batches: int
    batches: Batches
    source: data.ClickSource | None = None

    @property
    def bad_rows(self) -> int:
        """Unreadable rows skipped so far (`--skip-bad-rows`)."""
        return self.source.bad_rows if isinstance(self.source, data.StreamedClicks) else 0


def _sources(args: argparse.Namespace) -> _Scanned:
    """What to scan."""
    check_read_options(args)
    if args.data is None:
        sizes = {} if args.batch_size is None else {"batch_size": args.batch_size}
        workload = data.get_workload(args.workload or "criteo", seed=args.seed, **sizes)
        check_batches(workload)  # one batch at a time: before the first is drawn
        return _Scanned(workload.name, workload.batch_size, tuple(workload.features),
                        args.batches, lambda: workload.batches(args.batches))
    if args.workload is not None or args.data.suffix == ".npz":
        features, size, batch = _data_batch(args)
        return _Scanned(args.workload or "data", size, features, 1, lambda: iter([batch]))
    source = open_data(args, held_out=0)
    specs = data.click_feature_specs(source.features, source.batch_size,
                                     embedding_dim=EMBEDDING_DIM)
    return _Scanned("data", source.batch_size, tuple(specs), args.batches,
                    lambda: (source.train_batch(i).sparse for i in range(args.batches)), source)


class Progress:
    """`label [#####-----] i/n` on stderr: redrawn in place on a terminal, else once at the end."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total = label, total
        self.stream = sys.stderr if stream is None else stream
        self.live = self.stream.isatty()

    def __call__(self, done: int) -> None:
        if not self.live and done < self.total:
            return
        width = 30
        filled = width * done // max(self.total, 1)
        end = "\n" if done >= self.total else ""
        self.stream.write(f"\r{self.label} [{'#' * filled}{'-' * (width - filled)}] "
                          f"{done}/{self.total} batches{end}")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    topologies = args.topology or [tc.Topology(global_devices=1, sc_per_device=4)]
    scanned = _sources(args)
    results = []
    try:
        for topology in topologies:
            plan = tc.plan_stacking(scanned.features, topology)
            scans = scan(plan, scanned.batches(),
                         progress=Progress(f"scanning {topology}", scanned.num_batches))
            results.append((plan, scans, report(plan, scans)))
    finally:
        if isinstance(scanned.source, data.StreamedClicks):
            scanned.source.close()  # its open file, at once (not when garbage collection runs)
    summary = {
        "workload": scanned.name,
        "source": str(args.data) if args.data is not None else "workload",
        "batch_size": scanned.batch_size,
        "batches": scanned.num_batches,
        "seed": args.seed,
        "topologies": [r for _, _, r in results],
        "bad_rows": scanned.bad_rows,
    }
    for result in summary["topologies"]:
        print(format_report(result, summary))
    if summary["bad_rows"]:
        print(f"bad rows {summary['bad_rows']} skipped (unreadable rows of --data)")
    if args.json is not None:
        write_json(args.json, summary)
    if args.plot is not None:
        from ._limits_plot import plot_load

        write_file(args.plot, plot_load([r for _, _, r in results]))
        print(f"wrote {args.plot}")
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_report(result: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    """One topology's per-stack tables, as printed."""
    lines = [f"limits: workload={summary['workload']} source={summary['source']} "
             f"batch={summary['batch_size']} batches={summary['batches']} "
             f"topology={result['topology']} ({result['num_partitions']} partitions)"]
    for name, s in result["stacks"].items():
        obs, cur, rec = s["observed"], s["current"], s["recommended"]
        k = s["minibatches_needed_estimate"]
        pct = 100 * s["dropped_ids"] / s["ids"] if s["ids"] else 0.0
        rows = [
            ("max IDs / partition", obs["max_ids_per_partition"],
             cur["max_ids_per_partition"], rec["max_ids_per_partition"]),
            ("max unique / partition", obs["max_unique_ids_per_partition"],
             cur["max_unique_ids_per_partition"], rec["max_unique_ids_per_partition"]),
            ("COO buffer / device", f"{obs['required_buffer_size_per_sc']}/SC",
             cur["coo_buffer_size_per_device"], rec["coo_buffer_size_per_device"]),
            ("HBM stack forward", "", _mib(cur["forward_hbm_stack_bytes"]),
             _mib(rec["forward_hbm_stack_bytes"])),
            ("HBM stack backward", "", _mib(cur["backward_hbm_stack_bytes"]),
             _mib(rec["backward_hbm_stack_bytes"])),
        ]
        lines.append(f"  stack {name} ({len(s['tables'])} tables, {len(s['features'])} features)")
        lines.append(f"    {'':24}{'observed':>12}{'current':>14}{'recommended':>14}")
        lines += [f"    {a:24}{b!s:>12}{c!s:>14}{d!s:>14}" for a, b, c, d in rows]
        lines.append(f"    {'padding overhead':24}{100 * s['padding_overhead']:>11.1f}%")
        lines.append(f"    {'minibatches needed':24}{k:>12}  (estimate under the current "
                     "limits" + ("; more than the 64 minibatching can make: a partition's load "
                                 "is over 64 times its limit, raise it" if k > 64 else "") + ")")
        lines.append(f"    {'IDs dropped':24}{s['dropped_ids']:>12}  of {s['ids']} "
                     f"({pct:.2f}%) under the current limits")
    lines.append(f"  all stacks: minibatches needed {result['minibatches_needed_estimate']} "
                 f"(estimate), IDs dropped {result['dropped_ids']}")
    return "\n".join(lines)
