"""`tilecore bench train`: is the host or the device the training job's bottleneck?

Three measurements of the `tilecore train` click model, interleaved over
--repeats rounds (medians reported, as this machine is shared and noisy):
- input: examples/s the input pipeline alone delivers (generate, preprocess, put
  on the device; no step), with the run's threads or worker processes;
- staged: examples/s of training on --staged batches put on the device before
  the loop and cycled, so the host prepares nothing: the device's ceiling;
- train: examples/s of training as `tilecore train` does it.
train / staged near 1 means the host keeps the device busy; input / staged says
how much headroom the input pipeline has. On the CPU backend host and device
share the cores, so preparing batches slows the steps even when input / staged
is well above 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import statistics
from typing import Any

import tilecore as tc

from .._common import add_threads_option, write_json
from .._options import output_file, positive_int
from ._machine import machine_facts

HOST_BOUND_BELOW = 0.9
"""train / staged under this: the host, not the device, limits training."""


def add_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "train",
        help="tell whether the host's input pipeline or the device limits `tilecore train`",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch-size", type=positive_int, default=1024, help="examples per step (default 1024)")
    p.add_argument("--steps", type=int, default=300,
                   help="steps (and input-only batches) per measurement (default 300)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of the three measurements (default 3)")
    p.add_argument("--staged", type=int, default=8, metavar="N",
                   help="batches cycled by the staged run (default 8)")
    p.add_argument("--prefetch", type=int, default=2, help="batches prepared ahead (default 2)")
    p.add_argument("--input-processes", type=int, default=0, metavar="N",
                   help="prepare batches in N worker processes (default 0: prefetch threads)")
    add_threads_option(p)
    p.add_argument("--preprocess-on", choices=("host", "device", "auto"), default="auto",
                   help="where batches are packed, as `tilecore train --preprocess-on` "
                        "(device: in the main process, without minibatching, no "
                        "--input-processes; default auto)")
    p.add_argument("--no-pipelining", dest="pipelining", action="store_false",
                   help="plain steps instead of pipelined ones")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="write results here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    _check(args)
    import jax

    from tilecore import data
    from tilecore_apps import dlrm

    source = data.clicks(batch_size=args.batch_size)
    config = dlrm.TrainConfig(
        steps=args.steps, eval_every=args.steps, eval_batches=1, prefetch=args.prefetch,
        input_processes=args.input_processes, num_threads=args.threads,
        pipelining=args.pipelining, preprocess_on=args.preprocess_on,
        minibatching=args.preprocess_on != "device")
    runs, waits = _rounds(source, config, args)
    median = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "train_examples_per_s": median["train"],
        "staged_examples_per_s": median["staged"],
        "input_examples_per_s": median["input"],
        "train_over_staged": median["train"] / median["staged"],
        "input_over_staged": median["input"] / median["staged"],
        "host_bound": median["train"] / median["staged"] < HOST_BOUND_BELOW,
        "input_wait_fraction": statistics.median(waits),
        "runs": runs,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "repeats": args.repeats,
        "staged_batches": args.staged,
        "prefetch": args.prefetch,
        "input_processes": args.input_processes,
        "threads": args.threads,
        "preprocess_on": args.preprocess_on,
        "pipelining": args.pipelining,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "tilecore_version": tc.__version__,
        "jax_version": jax.__version__,
        **machine_facts(),
    }
    verdict = _verdict(result, cpu=jax.default_backend() == "cpu")
    print(f"train {median['train']:,.0f}, staged (device ceiling) {median['staged']:,.0f}, "
          f"input only {median['input']:,.0f} examples/s (medians of {args.repeats}): train / "
          f"staged {result['train_over_staged']:.2f}, input / staged "
          f"{result['input_over_staged']:.2f}: {verdict}")
    if args.json is not None:
        write_json(args.json, result)
    return 0


def _check(args: argparse.Namespace) -> None:
    """The counts are counts, before anything is built."""
    for name in ("batch_size", "repeats", "staged"):
        if getattr(args, name) < 1:
            raise ValueError(f"bench train: --{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}.")
    if args.steps < 3:
        raise ValueError(f"bench train: --steps must be >= 3 (the first compiles), got "
                         f"{args.steps}.")
    for name in ("prefetch", "input_processes"):
        if getattr(args, name) < 0:
            raise ValueError(f"bench train: --{name.replace('_', '-')} must be >= 0, got "
                             f"{getattr(args, name)}.")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"bench train: --threads must be >= 1, got {args.threads}.")


def _rounds(source: Any, config: Any, args: argparse.Namespace
            ) -> tuple[dict[str, list[float]], list[float]]:
    """`--repeats` rounds of the input pipeline alone, training on staged batches and
    training: each round's examples/s (printed as it ends) and the training's input waits."""
    from tilecore_apps import dlrm

    staged = dataclasses.replace(config, staged_batches=args.staged, input_processes=0)
    runs: dict[str, list[float]] = {"input": [], "staged": [], "train": []}
    waits = []
    for round_ in range(args.repeats):
        runs["input"].append(dlrm.input_rate(source, config, batches=args.steps))
        runs["staged"].append(_train(source, staged).examples_per_s)
        summary = _train(source, config)
        runs["train"].append(summary.examples_per_s)
        waits.append(summary.input_wait_fraction)
        print(f"round {round_ + 1}/{args.repeats}: " + ", ".join(
            f"{k} {v[-1]:,.0f}" for k, v in runs.items()) + " examples/s", flush=True)
    return runs, waits


def _verdict(result: dict[str, Any], *, cpu: bool) -> str:
    if not result["host_bound"]:
        return "the host keeps the device busy"
    if result["input_over_staged"] < 1:
        return "the host limits training: its input pipeline is slower than the device"
    return ("the host limits training: its input pipeline is fast enough alone but slows the "
            "steps" + (" (on the CPU backend, host and device share the cores)" if cpu else
                       " (the main thread's dispatch, or the transfers)"))


def _train(source: Any, config: Any) -> Any:
    from tilecore_apps import dlrm

    return dlrm.train(source, config, progress=io.StringIO()).summary
