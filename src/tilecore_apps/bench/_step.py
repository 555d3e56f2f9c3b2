"""`tilecore bench step`: time a training step with the fused ops, and the naive JAX way."""

from __future__ import annotations

import argparse
import gc
import resource
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

import tilecore as tc
from tilecore import data
from tilecore.specs import DEFAULT_AXIS, WEIGHTS_DTYPES  # (not tilecore.ops: it loads JAX)

from .._common import (
    add_threads_option,
    add_workload_option,
    calibrate,
    effective_threads,
    flags_topology,
    preprocess_dropping,
    write_json,
)
from .._fits import check_batches
from .._options import output_file, positive_float, positive_int, program, seed_int
from ._machine import OtherLoad, machine_facts
from ._memory import PeakProbe, mapped_file_mb
from ._timing import median_seconds

OPTIMIZER_NAMES = ("sgd", "adagrad", "adagrad_momentum", "adam", "ftrl", "laprop")
WEIGHTS_DTYPE_NAMES = tuple(d.name for d in WEIGHTS_DTYPES)


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "step",
        help="time forward and training steps of the device ops against a naive JAX step",
        description=(
            "Build a workload's plan with --optimizer on every table, calibrate the limits on "
            "the first batch (with --headroom), preprocess --batches batches (not timed), then "
            "time with jit and block_until_ready, median of --repeats calls after --warmup: "
            "the forward pass (lookup) and the training step (lookup, a dense loss on the "
            "activations, jax.grad, lookup_grad with the variables donated); and the same two "
            "written naively (dense tables, jnp.take + segment_sum, dense jax.grad over the "
            "tables, an optax update)."
        ),
    )
    _add_plan_options(p)
    _add_timing_options(p)
    _add_comparison_options(p)
    p.set_defaults(run=run)


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    """What is timed: the workload, its plan and tables."""
    add_workload_option(p, "criteo26")
    p.add_argument("--optimizer", default="adagrad", choices=OPTIMIZER_NAMES,
                   help="optimizer of every table, with its default hyperparameters "
                        "(default adagrad)")
    p.add_argument("--devices", type=int, default=1,
                   help="devices of the mesh (default 1). On CPU the command re-runs itself with "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=D if JAX has fewer, "
                        "D at most the larger of 256 and 4 per CPU")
    p.add_argument("--sc-per-device", type=int, default=1,
                   help="logical SparseCores per device (default 1)")
    p.add_argument("--weights-dtype", default="float32", choices=WEIGHTS_DTYPE_NAMES,
                   help="storage of every table (TableSpec weights_dtype; default float32): "
                        "bfloat16 or float16 halve the bytes of each looked-up row and write "
                        "updated rows with stochastic rounding. The naive step keeps float32 "
                        "tables")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="samples per batch (default: the workload's, 4096 for criteo26)")
    p.add_argument("--max-vocab", type=int, default=None, metavar="V",
                   help="cap every table's vocabulary at V, IDs taken modulo it (default: "
                        "the workload's; a quick run at a small size)")
    p.add_argument("--activation-mem-mb", type=positive_float, default=None, metavar="MB",
                   help="auto-stacking's activation memory per SparseCore in MiB "
                        "(SparseCoreConfig's activation_mem_bytes_limit; default 2, as the "
                        "reference's): more stacks tables of a larger batch together, into "
                        "fewer and larger kernels")


def _add_timing_options(p: argparse.ArgumentParser) -> None:
    """How it is prepared and timed."""
    p.add_argument("--repeats", type=int, default=10, help="timed calls of each (default 10)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls first, compilation included (default 2)")
    p.add_argument("--batches", type=int, default=3, help="distinct batches (default 3)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="limits = batch 0's maxima x (1 + headroom) (default 0.1)")
    add_threads_option(p)
    p.add_argument("--seed", type=seed_int, default=0, help="workload seed (default 0)")
    p.add_argument("--minibatching", action="store_true",
                   help="preprocess with enable_minibatching (the minibatched buffer layout and "
                        "the ops' loop over minibatches), limits calibrated as without it")
    p.add_argument("--minibatch-split", type=int, default=1, metavar="F",
                   help="with --minibatching: divide every stack's per-partition limits by F "
                        "(after calibration), so batches split into minibatches (default 1)")


def _add_comparison_options(p: argparse.ArgumentParser) -> None:
    """What it is compared with, on which pages, and where the results go."""
    p.add_argument("--no-naive", action="store_true", help="skip the naive step")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="keep the tables on the 4 KiB pages XLA allocated them on (default: "
                        "move them onto transparent huge pages with tilecore.ops.use_huge_pages, "
                        "and run FBGEMM with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 so that its "
                        "tables are on them too)")
    p.add_argument("--peer-python", type=program, default=None, metavar="PYTHON",
                   help="also time FBGEMM's table-batched embeddings (forward, and the step "
                        "with the same optimizer fused: sgd or adagrad; float32 or float16 "
                        "tables) on the same batches, run by this Python (a venv with torch and "
                        "fbgemm-gpu-cpu; never a tilecore dependency), and print the ratios. Pin "
                        "the threads "
                        "of both with taskset, e.g. `taskset -c 0 tilecore bench step ...`")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="write results here")


def _argv(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces `args` (for re-running in a child process)."""
    argv = ["bench", "step", "--workload", args.workload, "--optimizer", args.optimizer,
            "--devices", str(args.devices), "--sc-per-device", str(args.sc_per_device),
            "--repeats", str(args.repeats), "--warmup", str(args.warmup),
            "--batches", str(args.batches), "--headroom", str(args.headroom),
            "--seed", str(args.seed), "--minibatch-split", str(args.minibatch_split),
            "--weights-dtype", args.weights_dtype]
    for flag, value in (("--threads", args.threads), ("--json", args.json),
                        ("--peer-python", args.peer_python),
                        ("--batch-size", args.batch_size), ("--max-vocab", args.max_vocab),
                        ("--activation-mem-mb", args.activation_mem_mb)):
        if value is not None:
            argv += [flag, str(value)]
    if args.minibatching:
        argv.append("--minibatching")
    if args.no_huge_pages:
        argv.append("--no-huge-pages")
    return [*argv, "--no-naive"] if args.no_naive else argv


def _check(args: argparse.Namespace) -> None:
    for name in ("devices", "sc_per_device", "repeats", "batches", "minibatch_split"):
        if getattr(args, name) < 1:
            raise ValueError(f"bench step: --{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}.")
    try:  # before a child process is started with --devices CPU devices
        flags_topology(args.devices, args.sc_per_device)
    except ValueError as error:
        raise ValueError(f"bench step: {error}") from None
    if args.minibatch_split > 1 and not args.minibatching:
        raise ValueError(f"bench step: --minibatch-split {args.minibatch_split} needs "
                         "--minibatching.")
    if args.warmup < 1:
        raise ValueError(f"bench step: --warmup must be >= 1 (it compiles), got {args.warmup}.")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"bench step: --threads must be >= 1, got {args.threads}.")
    if args.max_vocab is not None and args.max_vocab < 1:
        raise ValueError(f"bench step: --max-vocab must be >= 1, got {args.max_vocab}.")
    if args.peer_python is not None:
        from ._peer import check_peer

        check_peer(args.peer_python, args.optimizer, args.weights_dtype)
    if not args.no_naive:
        try:
            import optax  # noqa: F401
        except ModuleNotFoundError:
            raise ValueError(
                "bench step: the naive step needs optax; `pip install optax` (or tilecore[dev]) "
                "or pass --no-naive."
            ) from None


def _cap_ids(batch: Mapping[str, tc.Ragged], features: list[tc.FeatureSpec]
             ) -> dict[str, tc.Ragged]:
    vocab = {f.name: f.table.vocab_size for f in features}
    return {name: tc.Ragged(r.values % vocab[name], r.row_splits, r.weights)
            for name, r in batch.items()}


def run(args: argparse.Namespace) -> int:
    _check(args)
    import jax

    if jax.device_count() < args.devices:
        from .._devices import rerun_with_cpu_devices

        return rerun_with_cpu_devices(args.devices, _argv(args))
    from .._devices import make_mesh
    from ._fused import OPTIMIZERS, bench_features, projections

    sizes = {} if args.batch_size is None else {"batch_size": args.batch_size}
    workload = data.get_workload(args.workload, seed=args.seed, **sizes)
    check_batches(workload, args.batches, "--batches")  # all drawn before any is timed
    optimizer = OPTIMIZERS[args.optimizer]()
    features = bench_features(workload.features, optimizer, max_vocab=args.max_vocab,
                              weights_dtype=args.weights_dtype)
    topology = flags_topology(args.devices, args.sc_per_device)
    config = tc.SparseCoreConfig() if args.activation_mem_mb is None else tc.SparseCoreConfig(
        activation_mem_bytes_limit=max(1, round(args.activation_mem_mb * 2**20)))
    plan = tc.plan_stacking(features, topology, config)
    threads = effective_threads(args.threads)
    raw = [_cap_ids(workload.batch(i, num_threads=threads), features)
           for i in range(args.batches)]
    plan, _ = calibrate(plan, raw[:1], num_threads=args.threads, headroom=args.headroom)
    if args.minibatching:
        plan = _minibatching(plan, args.minibatch_split)
    prepped = [preprocess_dropping(plan, b, num_threads=args.threads) for b in raw]

    mesh = make_mesh(args.devices, DEFAULT_AXIS)
    weights = projections(features, args.seed)
    timing = {"warmup": args.warmup, "repeats": args.repeats}
    times = _time_fused(plan, [b for b, _ in prepped], mesh, weights, args.seed, timing,
                        huge_pages=not args.no_huge_pages)
    forward_s, step_s = times.forward_s, times.step_s
    peak_mb = max(times.setup_peak_mb, times.step_peak_mb)  # before any child process
    peer = _peer(args, features, raw, optimizer, timing, workload.batch_size, forward_s, step_s,
                 huge_pages=times.huge_page_bytes > 0)
    naive: dict[str, Any] = {}
    if not args.no_naive:
        from ._naive import time_naive

        naive = time_naive(features, raw, weights, optimizer, mesh, args.seed, timing)

    ids = float(np.mean([data.num_ids(b) for b in raw]))
    result = _result(args, workload.batch_size, len(plan.stacks), forward_s, step_s, naive)
    result.update(minibatching=args.minibatching,
                  num_minibatches=[int(np.max(b.num_minibatches)) for b, _ in prepped])
    result.update(peak_rss_mb=peak_mb, step_peak_rss_mb=times.step_peak_mb,
                  file_rss_mb=times.file_mb, other_cpus=times.other_cpus,
                  huge_pages_gb=times.huge_page_bytes / 1e9, **peer)
    result.update(ids_per_batch=ids, forward_ids_per_s=ids / forward_s, ids_per_s=ids / step_s,
                  dropped_ids=sum(stats.dropped_ids for _, stats in prepped),
                  preprocess_threads=threads, **timing)
    if naive:
        result["naive_ids_per_s"] = ids / naive["step_s"]
    _print(result)
    if args.json is not None:
        write_json(args.json, result)
    return 0


def _peer(args: argparse.Namespace, features: list[tc.FeatureSpec],
          raw: list[dict[str, tc.Ragged]], optimizer: tc.OptimizerSpec,
          timing: Mapping[str, int], batch_size: int, forward_s: float, step_s: float,
          huge_pages: bool) -> dict[str, Any]:
    """The forward's and the update's bytes/s against the copy bandwidth where the tables
    live (the update's time is the step's less the forward's); with --peer-python,
    FBGEMM's times on the same batches and the ratios (FBGEMM's time / tilecore's: > 1
    means faster)."""
    from ._peer import copy_bandwidth, forward_bytes, run_peer, update_bytes

    copy = copy_bandwidth()
    moved = forward_bytes(features, raw, batch_size) / forward_s
    slots = len(optimizer.slot_names)
    update_s = max(step_s - forward_s, 1e-9)
    updated = update_bytes(features, raw, batch_size, slots) / update_s
    out: dict[str, Any] = {"copy_bandwidth_gb_s": copy / 1e9, "forward_gb_s": moved / 1e9,
                           "forward_fraction_of_copy": moved / copy,
                           "update_ms": update_s * 1e3, "update_gb_s": updated / 1e9,
                           "update_fraction_of_copy": updated / copy}
    if args.peer_python is None:
        return out
    load = OtherLoad.start()
    peer = run_peer(args.peer_python, features, raw, optimizer, args.optimizer, timing,
                    args.seed, huge_pages)
    out["peer_other_cpus"] = load.cpus()  # the peer's whole run: its set-up too
    out.update(peer_forward_ms=peer["forward_s"] * 1e3, peer_step_ms=peer["step_s"] * 1e3,
               peer_threads=peer["threads"], peer_peak_rss_mb=peer["peak_rss_mb"],
               peer_step_peak_rss_mb=peer["step_peak_rss_mb"],
               peer_file_rss_mb=peer["file_rss_mb"],
               peer_versions=f"torch {peer['torch_version']}, fbgemm {peer['fbgemm_version']}",
               peer_weights_precision=peer["weights_precision"],
               peer_forward_ratio=peer["forward_s"] / forward_s,
               peer_step_ratio=peer["step_s"] / step_s)
    return out


def _minibatching(plan: tc.StackingPlan, split: int) -> tc.StackingPlan:
    """`plan` with minibatching on and every stack's partition limits divided by `split`.

    The calibrated COO buffer stays (it holds the whole batch, all its minibatches), so
    the divided limits must still be able to fill it: 64 minibatches of partitions full
    to the limit. A larger `split` is refused here, naming --minibatch-split and the
    largest value this plan takes, not when preprocessing meets the buffer."""
    plan = plan.with_config(enable_minibatching=True)
    if split > 1 and _buffers_fit(plan) and not _buffers_fit(_split(plan, split)):
        low, high = 1, split  # the buffers fit at 1 (calibrated), not at `split`: bisect
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if _buffers_fit(_split(plan, mid)) else (low, mid)
        raise ValueError(
            f"bench step: --minibatch-split {split} leaves the limits too small to fill the "
            f"COO buffer calibrated for the whole batch (at most 64 minibatches of full "
            f"partitions); the largest --minibatch-split this workload takes is {low}.")
    return _split(plan, split)


def _split(plan: tc.StackingPlan, split: int) -> tc.StackingPlan:
    """`plan` with every stack's partition limits divided by `split` (at least 1)."""
    for name, stack in plan.stacks.items():
        plan = plan.with_stack_limits(
            name, max_ids_per_partition=max(1, stack.max_ids_per_partition // split),
            max_unique_ids_per_partition=max(1, stack.max_unique_ids_per_partition // split))
    return plan


def _buffers_fit(plan: tc.StackingPlan) -> bool:
    """Whether every stack's suggested COO buffer is one its limits can fill."""
    try:
        for stack in plan.stacks.values():
            tc.coo_buffer_size_per_device(stack, plan.topology, enable_minibatching=True)
    except ValueError:
        return False
    return True


class FusedTimes(NamedTuple):
    """What `_time_fused` measured."""

    forward_s: float
    step_s: float
    setup_peak_mb: float
    step_peak_mb: float
    huge_page_bytes: int
    file_mb: float
    other_cpus: float | None  # CPUs other processes kept busy while the calls were timed


def _time_fused(plan: tc.StackingPlan, prepped: list[tc.PreprocessedBatch], mesh: Any,
                weights: Mapping[str, np.ndarray], seed: int, timing: Mapping[str, int],
                huge_pages: bool = True) -> FusedTimes:
    """Median seconds of the fused forward and training step over `prepped` (cycled); the
    resident MB at the peak before the timed calls (initialising the tables, compiling and
    the warm-up calls) and at the peak of the timed calls (tables, batches and the steps'
    buffers); the bytes of variables moved onto huge pages (`huge_pages`)."""
    import jax

    from tilecore import ops

    from ._fused import Steps, fused_forward, put_batches

    batches = put_batches(prepped, mesh)
    n = len(batches)
    variables = ops.init_tables(plan, jax.random.key(seed), mesh=mesh)
    jax.block_until_ready(variables)
    moved = ops.use_huge_pages(variables) if huge_pages else 0
    forward, steps = fused_forward(plan, mesh), Steps(plan, batches, mesh, weights, variables)
    del variables  # donated by the first step: `steps.variables` are the live ones

    def forward_call(i: int) -> Any:
        return forward(steps.variables, batches[i % n])

    warmup, repeats = timing["warmup"], timing["repeats"]
    for call in (forward_call, steps):  # compiled and warm before the peak is reset
        for i in range(warmup):
            jax.block_until_ready(call(i))
    setup_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    probe, load = PeakProbe.start(), OtherLoad.start()  # the probe resets ru_maxrss too
    forward_s = median_seconds(lambda i: forward_call(warmup + i), warmup=0, repeats=repeats)
    step_s = median_seconds(lambda i: steps(warmup + i), warmup=0, repeats=repeats)
    other = load.cpus()
    peak_mb = probe.peak_bytes() / 2**20
    file_mb = mapped_file_mb()
    steps.variables = None
    gc.collect()  # the tables go; the rest before the naive step runs
    return FusedTimes(forward_s, step_s, setup_peak_mb, peak_mb, moved, file_mb, other)


def _result(args: argparse.Namespace, batch_size: int, stacks: int, forward_s: float,
            step_s: float, naive: Mapping[str, Any]) -> dict[str, Any]:
    import jax

    result: dict[str, Any] = {
        "workload": args.workload, "optimizer": args.optimizer, "devices": args.devices,
        "weights_dtype": args.weights_dtype,
        "sc_per_device": args.sc_per_device, "backend": jax.default_backend(),
        "batch_size": batch_size, "max_vocab": args.max_vocab, "stacks": stacks,
        "activation_mem_mb": args.activation_mem_mb,
        "batches": args.batches, "forward_ms": forward_s * 1e3, "step_ms": step_s * 1e3,
        "forward_examples_per_s": batch_size / forward_s, "examples_per_s": batch_size / step_s,
    }
    if naive:
        result.update({
            "naive_update": naive["update"],
            "naive_forward_ms": naive["forward_s"] * 1e3, "naive_step_ms": naive["step_s"] * 1e3,
            "naive_forward_examples_per_s": batch_size / naive["forward_s"],
            "naive_examples_per_s": batch_size / naive["step_s"],
            "forward_speedup_vs_naive": naive["forward_s"] / forward_s,
            "speedup_vs_naive": naive["step_s"] / step_s,
        })
    result.update({
        "tilecore_version": tc.__version__, "jax_version": jax.__version__,
        "device_kind": jax.devices()[0].device_kind, **machine_facts(),
    })
    return result


def _print(r: dict[str, Any]) -> None:
    lines = [
        f"bench step: workload={r['workload']} optimizer={r['optimizer']} devices={r['devices']}"
        f"x{r['sc_per_device']} backend={r['backend']} batch={r['batch_size']} "
        f"stacks={r['stacks']} tables={r['weights_dtype']}"
        + (f" minibatches={r['num_minibatches']}" if r["minibatching"] else ""),
        f"  {r['ids_per_batch'] / 1e6:.3f} M IDs/batch ({r['dropped_ids']} dropped), median of "
        f"{r['repeats']} calls after {r['warmup']} warm-up, over {r['batches']} batches",
        "                 ms/batch    examples/s        IDs/s",
        _row("fused forward", r["forward_ms"], r["forward_examples_per_s"], r["forward_ids_per_s"]),
        _row("fused step", r["step_ms"], r["examples_per_s"], r["ids_per_s"]),
    ]
    lines += [f"  forward moves {r['forward_gb_s']:.1f} GB/s, "
                 f"{100 * r['forward_fraction_of_copy']:.0f}% of this machine's copy bandwidth "
                 f"({r['copy_bandwidth_gb_s']:.1f} GB/s); the update (step less forward, "
                 f"{r['update_ms']:.2f} ms) {r['update_gb_s']:.1f} GB/s, "
                 f"{100 * r['update_fraction_of_copy']:.0f}%",
              f"  peak memory of the timed calls "
              f"{r['step_peak_rss_mb']:,.0f} MB, {r['file_rss_mb']:,.0f} MB of it mapped files "
              f"(library code; of the run {r['peak_rss_mb']:,.0f} MB); "
              + (f"variables on huge pages: {r['huge_pages_gb'] * 1e3:,.0f} MB"
                 if r["huge_pages_gb"]
                 else "variables on 4 KiB pages")]
    if "peer_step_ms" in r:
        ids = r["ids_per_batch"]
        lines += [
            _row("FBGEMM forward", r["peer_forward_ms"], r["batch_size"] / r["peer_forward_ms"]
                 * 1e3, ids / r["peer_forward_ms"] * 1e3),
            _row("FBGEMM step", r["peer_step_ms"], r["batch_size"] / r["peer_step_ms"] * 1e3,
                 ids / r["peer_step_ms"] * 1e3),
            f"  FBGEMM time / tilecore time: forward {r['peer_forward_ratio']:.2f}x, step "
            f"{r['peer_step_ratio']:.2f}x ({r['peer_threads']} threads, {r['peer_versions']}, "
            f"peak memory of the timed calls {r['peer_step_peak_rss_mb']:,.0f} MB, "
            f"{r['peer_file_rss_mb']:,.0f} MB of it mapped files, of the run "
            f"{r['peer_peak_rss_mb']:,.0f} MB, "
            f"{'on huge pages' if r['huge_pages_gb'] else 'on 4 KiB pages'})",
        ]
    if "naive_step_ms" in r:
        ids = r["ids_per_batch"]
        lines += [
            _row("naive forward", r["naive_forward_ms"], r["naive_forward_examples_per_s"],
                 ids / r["naive_forward_ms"] * 1e3),
            _row("naive step", r["naive_step_ms"], r["naive_examples_per_s"],
                 r["naive_ids_per_s"]),
            f"  speedup vs naive: forward {r['forward_speedup_vs_naive']:.1f}x, step "
            f"{r['speedup_vs_naive']:.1f}x (naive update: {r['naive_update']})",
        ]
    lines += _contention(r)
    print("\n".join(lines), file=sys.stdout)


BUSY_CPUS = 0.25
"""Other processes' CPUs above which a run's times are said to be inflated."""


def _contention(r: dict[str, Any]) -> list[str]:
    """A line saying that other processes competed for the CPUs while the calls were timed
    (the times and ratios then mean little), or none."""
    busy = {who: r.get(key) for who, key in (("tilecore", "other_cpus"),
                                              ("FBGEMM", "peer_other_cpus"))}
    busy = {who: cpus for who, cpus in busy.items() if cpus is not None}
    if not any(cpus > BUSY_CPUS for cpus in busy.values()):
        return []
    said = ", ".join(f"{cpus:.1f} while {who} was timed" for who, cpus in busy.items())
    return [f"  warning: other processes kept CPUs busy ({said}, of {r['cpu_count']}): "
            "these times are inflated; run again on an idle machine"]


def _row(name: str, ms: float, examples: float, ids: float) -> str:
    return f"  {name:<14}{ms:>10.2f}{examples:>14,.0f}{ids / 1e6:>11.2f} M"
