"""`tilecore train`: the main job — a DLRM-style click model trained end to end.

A thin driver over `tilecore_apps.dlrm.train`: it builds the data source and the
config from the options, makes sure JAX sees `--devices` CPU devices (the flag
must be set before JAX starts), picks the run's directory (`_runs`: a new one per
run unless `--out`) and writes the summary, plots and checkpoint there.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tilecore as tc
from tilecore import data

from .._common import add_threads_option, flags_topology, topology_arg, write_file, write_json
from .._devices import RERUN_ENV, max_cpu_devices, with_device_count
from .._options import (
    int_list,
    nonnegative_float,
    nonnegative_int,
    output_dir,
    output_file,
    positive_float,
    positive_int,
    seed_int,
)
from . import _runs
from ._data import add_read_options, check_read_options, open_data

if TYPE_CHECKING:
    from tilecore_apps.dlrm import TrainSummary

OPTIMIZERS = {"sgd": tc.SGD, "adagrad": tc.Adagrad, "adagrad_momentum": tc.AdagradMomentum,
              "adam": tc.Adam, "ftrl": tc.FTRL, "laprop": tc.LaProp}
DEFAULT_LR = {"sgd": 0.5, "adagrad": 0.3, "adagrad_momentum": 0.1, "adam": 0.01, "ftrl": 0.3,
              "laprop": 0.01}
DEFAULT_BATCH = 1024


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train", help="train a DLRM-style click model end to end (the main job)",
        description=(
            "Train embedding tables (tilecore ops) plus a DLRM-style dense model on synthetic "
            "click data whose labels come from a hidden model (or --data files): limits tuned "
            "by FDO first (batches over them split into minibatches), preprocessing prefetched "
            "in background threads (or --input-processes worker processes), periodic held-out "
            "evaluation (loss, AUC), Orbax checkpoints, a summary (JSON) and PNG plots. "
            f"Each run writes to a new directory, {_runs.DEFAULT_ROOT}/run-NNN "
            f"({_runs.DEFAULT_ROOT}/latest points at the newest), unless --out names one; "
            "--resume continues the newest run (or --out's) and --overwrite starts --out "
            "over."),
    )
    _add_model_options(p)
    _add_input_options(p)
    _add_output_options(p)
    p.set_defaults(run=run)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """Steps, batches, evaluation, optimizers and the tables' sizes."""
    p.add_argument("--steps", type=positive_int, default=1000,
                   help="steps to train in this run (default 1000); with --resume, steps "
                        "added to the checkpoint's (resuming step 1000 with --steps 500 "
                        "trains steps 1001-1500)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"examples per step (default {DEFAULT_BATCH}; .npz --data fixes it)")
    p.add_argument("--eval-every", type=positive_int, default=200,
                   help="steps between evaluations (default 200; also after the last step)")
    p.add_argument("--eval-batches", type=positive_int, default=4,
                   help="held-out batches (default 4; with a TSV or Parquet --data and no "
                        "--eval-data, its first batches)")
    p.add_argument("--optimizer", default="adagrad", choices=sorted(OPTIMIZERS),
                   help="optimizer of the tables (default adagrad)")
    p.add_argument("--learning-rate", type=positive_float, default=None,
                   help="tables' learning rate (default per optimizer, adagrad 0.3)")
    p.add_argument("--dense-learning-rate", type=positive_float, default=1e-2,
                   help="Adam's learning rate for the dense model (default 0.01)")
    p.add_argument("--embedding-dim", type=positive_int, default=16,
                   help="embedding width (default 16)")
    p.add_argument("--vocab-sizes", type=int_list, default=None, metavar="V1,V2,...",
                   help="vocabulary of each synthetic feature (default: 8 features, 500..100000); "
                        "with a TSV or Parquet --data, of each sparse feature, or one size for "
                        "all (IDs are hashed into it; default: the Parquet file's schema, else "
                        f"{data.DEFAULT_VOCAB_SIZE})")


def _add_input_options(p: argparse.ArgumentParser) -> None:
    """The topology, the input pipeline, the limits, and the data."""
    p.add_argument("--devices", type=positive_int, default=None,
                   help="devices of the mesh (default 1). On CPU, JAX is started with "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N, N at most the "
                        "larger of 256 and 4 per CPU")
    p.add_argument("--sc-per-device", type=positive_int, default=None,
                   help="logical SparseCores per device (default 4)")
    p.add_argument("--topology", type=topology_arg, default=None, metavar="LxS",
                   help="devices x SparseCores in one option, e.g. 2x4")
    p.add_argument("--prefetch", type=nonnegative_int, default=2,
                   help="batches preprocessed ahead in background threads (default 2)")
    p.add_argument("--input-processes", type=nonnegative_int, default=0, metavar="N",
                   help="generate and preprocess batches in N worker processes instead of "
                        "threads (no GIL contention with the training loop; for many-core "
                        "hosts; default 0: threads)")
    add_threads_option(p)
    p.add_argument("--preprocess-on", choices=("host", "device", "auto"), default="auto",
                   help="where batches are packed: the host (numpy/numba), the device (a jitted "
                        "program, the same bits; needs --no-minibatching and no "
                        "--input-processes) or auto: the side measured faster, today the "
                        "host (default auto)")
    p.add_argument("--tune-batches", type=positive_int, default=4,
                   help="batches the limits are tuned on before training (default 4)")
    p.add_argument("--headroom", type=nonnegative_float, default=0.1,
                   help="tuned limits x (1 + headroom) (default 0.1)")
    p.add_argument("--minibatching", action=argparse.BooleanOptionalAction, default=True,
                   help="split batches over the tuned limits into minibatches instead of "
                        "dropping IDs (default on)")
    p.add_argument("--pipelining", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap SparseCore and TensorCore stages (default on)")
    p.add_argument("--data", type=Path, default=None, metavar="PATH",
                   help="train on this click data instead of synthetic clicks: Criteo-format "
                        "TSV (.tsv, .txt, plain or .gz), Parquet (.parquet, or a directory of "
                        "them) or a directory of .npz click files; `tilecore data` writes a "
                        "sample of each")
    add_read_options(p, eval_data=True)
    p.add_argument("--seed", type=seed_int, default=0, help="data and model seed (default 0)")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Where the run goes, resuming or starting over, and what it writes."""
    p.add_argument("--out", type=output_dir, default=None, metavar="DIR",
                   help="checkpoint, plots and summary.json go here (default: a new "
                        f"./{_runs.DEFAULT_ROOT}/run-NNN per run); a DIR holding an earlier "
                        "run needs --resume or --overwrite")
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="K",
                   help="also save a checkpoint every K steps (default: only at the end); "
                        "the newest 2 are kept in OUT/checkpoint")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help=f"continue the newest run under ./{_runs.DEFAULT_ROOT}/ that has a "
                            "checkpoint (or --out's): its step, tables, slots, dense "
                            "parameters and optimizer state, then --steps more steps. Another "
                            "topology is allowed: the tables are converted to it (and it is "
                            "said)")
    again.add_argument("--overwrite", action="store_true",
                       help="start --out over: delete its checkpoint, plots and summary first")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH",
                   help="write the summary here too (it always goes to OUT/summary.json)")
    p.add_argument("--profile", type=output_dir, default=None, metavar="DIR",
                   help="write a jax.profiler trace (TensorBoard / Perfetto) of the loop here")


def _topology(args: argparse.Namespace) -> tc.Topology:
    if args.topology is not None:
        topology: tc.Topology = args.topology
        for flag, given, have in (("--devices", args.devices, topology.global_devices),
                                  ("--sc-per-device", args.sc_per_device, topology.sc_per_device)):
            if given is not None and given != have:
                raise ValueError(f"{flag} {given} contradicts --topology {topology}; "
                                 "give one of them.")
        return topology
    return flags_topology(args.devices or 1, args.sc_per_device or 4)


def _saved_topology(run_dir: Path, step: int) -> str:
    """The topology (`LxS`) the run's checkpoint `step` (the one resumed) was saved on."""
    from tilecore import checkpoint

    saved = checkpoint.read_metadata(run_dir / "checkpoint", step=step)["topology"]
    return f"{saved['global_devices']}x{saved['sc_per_device']}"


def _source(args: argparse.Namespace) -> Any:
    if args.data is not None:
        return open_data(args, held_out=args.eval_batches)
    sizes: dict[str, Any] = {}
    if args.vocab_sizes is not None:
        sizes["vocab_sizes"] = args.vocab_sizes
        sizes["multi_hot"] = {k: 8 for k in (2, 5) if k < len(sizes["vocab_sizes"])}
    return data.clicks(seed=args.seed, batch_size=args.batch_size or DEFAULT_BATCH, **sizes)


def _ensure_devices(count: int, argv: list[str]) -> int | None:
    """Start JAX with `count` CPU devices; an exit status if a child process had to run."""
    import jax
    from jax._src import xla_bridge  # no public way to ask whether the backends started

    # Read when the CPU backend starts. Past max_cpu_devices, JAX starts as it is: an
    # accelerator may have that many devices; on CPU, rerun_with_cpu_devices refuses it.
    if 1 < count <= max_cpu_devices() and not xla_bridge.backends_are_initialized():
        os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), count)

    if jax.device_count() >= count:
        return None
    from .._devices import rerun_with_cpu_devices

    if os.environ.get(RERUN_ENV):
        raise ValueError(f"--devices {count}: JAX has {jax.device_count()} device(s).")
    return rerun_with_cpu_devices(count, argv)


def run(args: argparse.Namespace) -> int:
    topology = _topology(args)
    check_read_options(args)
    status = _ensure_devices(topology.global_devices, _argv(args, topology))
    if status is not None:
        return status
    source = _source(args)
    run_dir = _runs.resolve(args.out, resume=args.resume, overwrite=args.overwrite)
    try:
        return _run_in(run_dir, args, topology, source)
    finally:
        _runs.release(run_dir.path)


def _run_in(run_dir: _runs.RunDir, args: argparse.Namespace, topology: tc.Topology,
            source: data.ClickSource) -> int:
    """Train in `run_dir` (claimed for this run) and write its outputs there."""
    from tilecore.checkpoint import CheckpointMismatchError, CheckpointTargetError
    from tilecore_apps import dlrm

    print(f"tilecore train: {run_dir.note}", flush=True)
    start, out = run_dir.start_step, run_dir.path
    if start and (saved := _saved_topology(out, start)) != str(topology):
        print(f"tilecore train: the checkpoint was saved on topology {saved}; converting its "
              f"tables and optimizer slots to {topology} (devices x SparseCores)",
              flush=True)
    optimizer = OPTIMIZERS[args.optimizer](
        learning_rate=args.learning_rate or DEFAULT_LR[args.optimizer])
    config = dlrm.TrainConfig(
        steps=start + args.steps, model=dlrm.ModelConfig(embedding_dim=args.embedding_dim),
        table_optimizer=optimizer, dense_learning_rate=args.dense_learning_rate,
        topology=topology, eval_every=args.eval_every, eval_batches=args.eval_batches,
        prefetch=args.prefetch, input_processes=args.input_processes,
        tune_batches=args.tune_batches, tune_headroom=args.headroom,
        minibatching=args.minibatching, pipelining=args.pipelining, num_threads=args.threads,
        preprocess_on=args.preprocess_on,
        seed=args.seed, profile_dir=args.profile, checkpoint_dir=out / "checkpoint",
        checkpoint_every=args.checkpoint_every, resume=start > 0,
    )
    steps = f"steps {start + 1}-{start + args.steps}" if start else f"{args.steps} steps"
    print(f"tilecore train: {len(source.features)} features, {source.num_dense} dense, batch "
          f"{source.batch_size}, {steps} on {topology} (devices x SparseCores)", flush=True)
    try:
        result = dlrm.train(source, config)
    except dlrm.NonFiniteLossError as error:
        print(f"tilecore train: error: {error}", file=sys.stderr)
        return 1
    except (CheckpointMismatchError, CheckpointTargetError) as error:
        print(f"tilecore train: error: cannot resume, the model differs from the checkpoint "
              f"(same --vocab-sizes, --embedding-dim, --optimizer and --dense-columns as the "
              f"saved run?). {error}", file=sys.stderr)
        return 2
    finally:
        if args.out is None and not start:
            _runs.discard_if_empty(out)  # a failed new run leaves no empty directory behind
    summary = result.summary
    print(summary.format())
    write_file(out / "loss_auc.png", dlrm.plot_curves(summary))
    write_file(out / "partition_load.png", dlrm.plot_partition_load(summary))
    print(f"wrote {out / 'loss_auc.png'} and {out / 'partition_load.png'}")
    if summary.checkpoint is not None:
        print(f"checkpoint {_shown(Path(summary.checkpoint))}")
    if args.profile is not None:
        print(f"profile trace in {args.profile} (open with TensorBoard or ui.perfetto.dev)")
    for path in (out / "summary.json", *([args.json] if args.json is not None else [])):
        write_json(path, summary.to_json())
    if summary.stopped_by is not None:
        return _stopped(summary, out)
    return 0


def _stopped(summary: TrainSummary, out: Path) -> int:
    """Say where a run stopped by a signal stands and how to go on; its exit status
    (128 + the signal's number, as the shell reports a process the signal ended)."""
    from tilecore import checkpoint

    left = (summary.requested_steps or summary.steps) - summary.steps
    saved = (f"its checkpoint is step {summary.steps}"
             if summary.steps in checkpoint.available_steps(out / "checkpoint")
             else "it stopped before its first step; nothing was saved")
    print(f"tilecore train: stopped by {summary.stopped_by} after step {summary.steps}, "
          f"{left} steps short; {saved}. Go on with: tilecore train --resume --out "
          f"{_shown(out)} --steps {left}", file=sys.stderr)
    number = getattr(signal.Signals, summary.stopped_by or "", None)
    return 128 + int(number) if number is not None else 1


def _shown(path: Path) -> Path:
    """`path` relative to the working directory when it lies below it (as the other paths
    the command prints are), else as it is."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def _argv(args: argparse.Namespace, topology: tc.Topology) -> list[str]:
    """The command line that reproduces `args` (for re-running in a child process)."""
    argv = ["train", "--topology", str(topology),
            "--pipelining" if args.pipelining else "--no-pipelining",
            "--minibatching" if args.minibatching else "--no-minibatching",
            *(["--resume"] if args.resume else []), *(["--overwrite"] if args.overwrite else []),
            *(["--skip-bad-rows"] if args.skip_bad_rows else [])]
    if args.vocab_sizes is not None:
        argv += ["--vocab-sizes", ",".join(map(str, args.vocab_sizes))]
    for flag in ("dense_columns", "sparse_columns"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", ",".join(getattr(args, flag))]
    for table, columns in args.shared_tables or ():
        argv += ["--shared-table", f"{table}={','.join(columns)}"]
    for flag in ("steps", "batch_size", "eval_every", "eval_batches", "optimizer",
                 "learning_rate", "dense_learning_rate", "embedding_dim", "prefetch",
                 "input_processes", "threads", "preprocess_on", "tune_batches", "headroom", "data", "eval_data",
                 "label_column", "seed", "out", "json", "profile", "checkpoint_every"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return argv
