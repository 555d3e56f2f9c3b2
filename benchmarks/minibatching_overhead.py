"""What minibatching costs host preprocessing: off vs on (not triggered) vs forced.

The three modes are timed in one process, call by call in turn over the same
batches, so machine noise hits them alike and the ratios hold even when absolute
times swing. `on` enables minibatching with limits calibrated on the batches (one
minibatch, the minibatched layout); `forced` halves those limits so every batch
splits (see `tilecore bench preprocess --minibatching`). `--cold` forgets the
memoised hash buckets before every call: the worst case, every row new.

    .venv/bin/python benchmarks/minibatching_overhead.py --workload criteo --threads 1 \
        --repeats 15 --json bench-results/minibatching-criteo.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import tilecore as tc
from tilecore import data
from tilecore.preprocessing._bucket_memo import clear_bucket_memo
from tilecore_apps._common import calibrate, parse_topology
from tilecore_apps.bench._preprocess import _with_minibatching

MODES = ("off", "on", "forced")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="criteo", choices=sorted(data.WORKLOADS))
    parser.add_argument("--topology", default="1x4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cold", action="store_true", help="clear the bucket memo per call")
    parser.add_argument("--json", default=None, help="write the medians and ratios here")
    args = parser.parse_args()

    workload = data.get_workload(args.workload, seed=0)
    batches = [workload.batch(i, num_threads=args.threads) for i in range(3)]
    plan = tc.plan_stacking(workload.features, parse_topology(args.topology))
    plan, _ = calibrate(plan, batches, num_threads=args.threads)
    plans = {mode: _with_minibatching(plan, mode) for mode in MODES}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    minibatches: dict[str, int] = {}
    warnings.simplefilter("ignore")  # `forced` may drop a row one bucket cannot hold
    for i in range(args.repeats + 2):  # two warm-up rounds
        for mode in MODES:
            if args.cold:
                clear_bucket_memo()
            t0 = time.perf_counter()
            batch, _ = tc.preprocess(plans[mode], batches[i % 3], num_threads=args.threads)
            if i >= 2:
                seconds[mode].append(time.perf_counter() - t0)
            minibatches[mode] = batch.num_minibatches
    medians = {mode: statistics.median(t) for mode, t in seconds.items()}
    result = {
        "workload": args.workload, "topology": args.topology, "threads": args.threads,
        "repeats": args.repeats, "cold": args.cold,
        "median_ms": {m: round(s * 1e3, 2) for m, s in medians.items()},
        "num_minibatches": minibatches,
        "ratio_to_off": {m: round(medians[m] / medians["off"], 3) for m in MODES[1:]},
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
