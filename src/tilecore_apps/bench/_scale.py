"""`tilecore bench scale`: the fused training step's time against vocabulary size and IDs per batch.

One table, one multi-hot feature, Zipf IDs (exponent 1.1, as criteo26) at a fixed batch
size. The vocabulary sweep holds the IDs per batch fixed, up to the vocabulary whose table
and optimizer slots no longer fit the memory budget: the step should cost what the rows a
batch touches cost, not what the table's size does (with Zipf IDs a larger vocabulary also
means more distinct rows per batch: the JSON has them). The IDs sweep holds the
vocabulary fixed and lengthens every sample: its step time should grow linearly.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import tilecore as tc
from tilecore import data
from tilecore.stacking import memory_estimates

from .._common import add_threads_option, calibrate, preprocess_dropping, write_file, write_json
from .._options import (
    int_list,
    nonnegative_float,
    output_file,
    positive_float,
    positive_int,
    seed_int,
)
from ._machine import available_memory_bytes, machine_facts
from ._memory import PeakProbe
from ._step import OPTIMIZER_NAMES

VOCAB_SIZES = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
IDS_PER_BATCH = (4_096, 16_384, 65_536, 262_144)
ZIPF_EXPONENT = 1.1
BUDGET_FRACTION = 0.5
"""Default memory budget: this fraction of the memory free when the command starts."""


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "scale",
        help="step time against vocabulary size and against IDs per batch (JSON, PNG)",
        description=(
            "Time the fused training step (the one `bench step` times: lookup, a dense loss, "
            "jax.grad, lookup_grad with the variables donated; median of --repeats calls "
            "after --warmup) on one table with one multi-hot feature of Zipf IDs, in two "
            "sweeps: over --vocab-sizes at --vocab-sweep-ids IDs per batch (sizes whose table "
            "and optimizer slots exceed --memory-limit-gb are skipped, never allocated), and "
            "over --ids-per-batch at --ids-sweep-vocab (linear). "
            "It runs on the JAX backend present: tilecore's CPU kernels on a CPU, the XLA "
            "path on a GPU; GPU figures come from running it on a GPU."
        ),
    )
    p.add_argument("--vocab-sizes", type=int_list, default=VOCAB_SIZES, metavar="V1,V2,...",
                   help="vocabulary sweep (default 1000,10000,100000,1000000,10000000)")
    p.add_argument("--vocab-sweep-ids", type=positive_int, default=32_768, metavar="N",
                   help="IDs per batch of the vocabulary sweep, a multiple of --batch-size "
                        "(default 32768)")
    p.add_argument("--ids-per-batch", type=int_list, default=IDS_PER_BATCH,
                   metavar="N1,N2,...", help="IDs sweep, multiples of --batch-size "
                                             "(default 4096,16384,65536,262144)")
    p.add_argument("--ids-sweep-vocab", type=positive_int, default=100_000, metavar="V",
                   help="vocabulary of the IDs sweep (default 100000)")
    p.add_argument("--sweep", default="both", choices=("both", "vocab", "ids"),
                   help="which sweeps to run (default both)")
    p.add_argument("--batch-size", type=positive_int, default=1024,
                   help="samples per batch; IDs per sample = IDs per batch / this (default 1024)")
    p.add_argument("--dim", type=positive_int, default=32, help="embedding width (default 32)")
    p.add_argument("--optimizer", default="adagrad", choices=OPTIMIZER_NAMES,
                   help="the table's optimizer, with its default hyperparameters "
                        "(default adagrad)")
    p.add_argument("--memory-limit-gb", type=positive_float, default=None, metavar="GB",
                   help="largest table + optimizer slots to allocate, in GB (default: half the "
                        "memory free at the start: the accelerator's if JAX reports it, else "
                        "MemAvailable from /proc/meminfo)")
    p.add_argument("--repeats", type=positive_int, default=10,
                   help="timed calls per point (default 10)")
    p.add_argument("--warmup", type=positive_int, default=2,
                   help="untimed calls first, compilation included (default 2)")
    p.add_argument("--batches", type=positive_int, default=3,
                   help="distinct batches per point (default 3)")
    p.add_argument("--headroom", type=nonnegative_float, default=0.1,
                   help="limits = batch 0's maxima x (1 + headroom) (default 0.1)")
    add_threads_option(p)
    p.add_argument("--seed", type=seed_int, default=0, help="workload seed (default 0)")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="write results here")
    p.add_argument("--plot", type=output_file, default=None, metavar="PATH.png",
                   help="write the two panels (step time against vocabulary and against IDs "
                        "per batch) here")
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> None:
    sizes = ([("--vocab-sweep-ids", args.vocab_sweep_ids)] if args.sweep != "ids" else []) + (
        [("--ids-per-batch", n) for n in args.ids_per_batch] if args.sweep != "vocab" else [])
    for flag, ids in sizes:
        if ids % args.batch_size:
            raise ValueError(
                f"bench scale: {flag} {ids} is not a multiple of --batch-size "
                f"{args.batch_size} (every sample holds the same number of IDs); use e.g. "
                f"{max(1, round(ids / args.batch_size)) * args.batch_size}.")


def _workload(vocab: int, ids_per_batch: int, args: argparse.Namespace) -> data.Workload:
    """One table of `vocab` rows, one feature of `ids_per_batch / batch_size` IDs a sample."""
    per_sample = ids_per_batch // args.batch_size
    table = tc.TableSpec(name="table", vocab_size=vocab, embedding_dim=args.dim)
    feature = tc.FeatureSpec(name="ids", table=table, input_shape=(args.batch_size, per_sample))
    dist = data.IdDistribution.scattered(table, exponent=ZIPF_EXPONENT, min_ids=per_sample,
                                         max_ids=per_sample, seed=args.seed)
    return data.Workload(name="scale", features=(feature,), distributions=(dist,),
                         batch_size=args.batch_size, seed=args.seed)


def _plan(vocab: int, ids_per_batch: int, args: argparse.Namespace
          ) -> tuple[data.Workload, list[tc.FeatureSpec], tc.StackingPlan, int]:
    """The point's workload, features, plan, and the bytes of its table and optimizer slots
    (padded; nothing is allocated). With `lean_init` those are the most that initialising
    the variables holds."""
    from ._fused import OPTIMIZERS, bench_features, lean_init

    workload = _workload(vocab, ids_per_batch, args)
    optimizer = OPTIMIZERS[args.optimizer]()
    features = bench_features(workload.features, optimizer, max_vocab=None,
                              initializer=lean_init)
    plan = tc.plan_stacking(features, tc.Topology(global_devices=1, sc_per_device=1))
    table = sum(m.table_bytes for m in memory_estimates(plan).values())
    return workload, features, plan, table * (1 + len(optimizer.slot_names))


def _bytes_needed(vocab: int, args: argparse.Namespace) -> int:
    """Bytes of a `vocab`-row table and its optimizer slots (any IDs per batch)."""
    return _plan(vocab, args.batch_size, args)[3]


def _measure(vocab: int, ids_per_batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build, calibrate and preprocess one point (not timed), then time its training step."""
    import jax

    from tilecore import ops

    from ._fused import projections, put_batches, time_step

    workload, features, plan, variable_bytes = _plan(vocab, ids_per_batch, args)
    raw = [workload.batch(i) for i in range(args.batches)]
    plan, _ = calibrate(plan, raw[:1], num_threads=args.threads, headroom=args.headroom)
    prepped = [preprocess_dropping(plan, b, num_threads=args.threads) for b in raw]
    batches = put_batches([b for b, _ in prepped], None)
    probe = PeakProbe.start()
    variables = ops.init_tables(plan, jax.random.key(args.seed))
    jax.block_until_ready(variables)
    step_s = time_step(plan, batches, None, projections(features, args.seed), variables,
                       {"warmup": args.warmup, "repeats": args.repeats})
    peak_mb = probe.peak_bytes() / 2**20
    gc.collect()
    ids = data.num_ids(raw[0])
    return {
        "vocab_size": vocab, "ids_per_batch": ids, "ids_per_sample": ids // args.batch_size,
        "unique_ids_per_batch": float(np.mean([len(np.unique(b["ids"].values)) for b in raw])),
        "variable_bytes": variable_bytes, "step_ms": step_s * 1e3, "ids_per_s": ids / step_s,
        "ns_per_id": step_s / ids * 1e9, "dropped_ids": sum(s.dropped_ids for _, s in prepped),
        "peak_rss_mb": peak_mb,
    }


def _point(vocab: int, ids_per_batch: int, args: argparse.Namespace,
           cache: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any]:
    """`_measure`'s result, measured once per point (the two sweeps may share one)."""
    if (vocab, ids_per_batch) not in cache:
        cache[vocab, ids_per_batch] = _measure(vocab, ids_per_batch, args)
    return cache[vocab, ids_per_batch]


def _budget(limit_gb: float | None) -> tuple[int, str]:
    """Bytes the table and its slots may take, and where that figure comes from."""
    if limit_gb is not None:
        return int(limit_gb * 1e9), "--memory-limit-gb"
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        where = f"{device.device_kind}'s memory"
    else:
        free, where = available_memory_bytes(), "MemAvailable"
        if free is None:
            raise ValueError("bench scale: cannot read this machine's free memory; pass "
                             "--memory-limit-gb.")
    return int(free * BUDGET_FRACTION), f"{BUDGET_FRACTION:.0%} of {where}"


def _vocab_sweep(args: argparse.Namespace, budget: int,
                 cache: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any]:
    """Ascending vocabularies until one's table and slots exceed `budget` (it and every
    larger one skipped, with a note saying so)."""
    ids, points, note = args.vocab_sweep_ids, [], None
    vocabs = sorted(set(args.vocab_sizes))
    for k, vocab in enumerate(vocabs):
        need = _bytes_needed(vocab, args)
        if need > budget:
            skipped = vocabs[k:]
            note = (f"stopped before vocab {vocab:,}: its table and {args.optimizer} slots "
                    f"take {need / 1e9:.3f} GB, over the {budget / 1e9:.3f} GB budget; "
                    f"skipped {', '.join(f'{v:,}' for v in skipped)}")
            break
        points.append(_point(vocab, ids, args, cache))
    return {"ids_per_batch": ids, "points": points,
            "skipped_vocab_sizes": vocabs[len(points):], "stopped": note}


def _ids_sweep(args: argparse.Namespace, cache: dict[tuple[int, int], dict[str, Any]]
              ) -> dict[str, Any]:
    vocab = args.ids_sweep_vocab
    points = [_point(vocab, n, args, cache) for n in sorted(set(args.ids_per_batch))]
    return {"vocab_size": vocab, "points": points}


def _check_ids_sweep_fits(args: argparse.Namespace, budget: int) -> None:
    need = _bytes_needed(args.ids_sweep_vocab, args)
    if need > budget:
        raise ValueError(
            f"bench scale: --ids-sweep-vocab {args.ids_sweep_vocab} needs {need / 1e9:.3f} GB "
            f"for its table and {args.optimizer} slots, over the {budget / 1e9:.3f} GB "
            "budget; pass a smaller --ids-sweep-vocab or a larger --memory-limit-gb.")


def run(args: argparse.Namespace) -> int:
    _check(args)
    import jax

    budget, source = _budget(args.memory_limit_gb)
    if args.sweep != "vocab":
        _check_ids_sweep_fits(args, budget)
    cache: dict[tuple[int, int], dict[str, Any]] = {}
    vocab = _vocab_sweep(args, budget, cache) if args.sweep != "ids" else None
    ids = _ids_sweep(args, cache) if args.sweep != "vocab" else None
    result: dict[str, Any] = {
        "optimizer": args.optimizer, "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind, "batch_size": args.batch_size,
        "dim": args.dim, "zipf_exponent": ZIPF_EXPONENT, "repeats": args.repeats,
        "warmup": args.warmup, "batches": args.batches, "headroom": args.headroom,
        "memory_limit_gb": budget / 1e9, "memory_limit_source": source,
        "vocab_sweep": vocab, "ids_sweep": ids,
        "tilecore_version": tc.__version__, "jax_version": jax.__version__, **machine_facts(),
    }
    _print(result)
    if args.json is not None:
        write_json(args.json, result)
    if args.plot is not None:
        from ._scale_plot import plot_scale

        write_file(args.plot, plot_scale(result))
        print(f"wrote {args.plot}")
    return 0


def _print(r: Mapping[str, Any]) -> None:
    lines = [f"bench scale: optimizer={r['optimizer']} backend={r['backend']} "
             f"({r['device_kind']}) batch={r['batch_size']} dim={r['dim']}, median of "
             f"{r['repeats']} calls after {r['warmup']} warm-up; memory budget "
             f"{r['memory_limit_gb']:.2f} GB ({r['memory_limit_source']})"]
    if (vocab := r["vocab_sweep"]) is not None:
        lines += [f"  vocabulary sweep, {vocab['ids_per_batch']:,} IDs per batch:",
                  *_table(vocab["points"])]
        if vocab["stopped"]:
            lines.append(f"    {vocab['stopped']}")
    if (ids := r["ids_sweep"]) is not None:
        lines += [f"  IDs sweep, vocabulary {ids['vocab_size']:,}:", *_table(ids["points"])]
    print("\n".join(lines), file=sys.stdout)


def _table(points: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = ["         vocab   IDs/batch   unique IDs   table+slots MB   ms/step   M IDs/s   ns/ID"]
    rows += [f"    {p['vocab_size']:>10,}{p['ids_per_batch']:>12,}{p['unique_ids_per_batch']:>13,.0f}"
             f"{p['variable_bytes'] / 1e6:>17,.1f}{p['step_ms']:>10.2f}"
             f"{p['ids_per_s'] / 1e6:>10.2f}{p['ns_per_id']:>8.1f}" for p in points]
    return rows
