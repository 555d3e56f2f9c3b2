"""Device time per kernel of one `tilecore` command, from JAX's profiler.

    python tools/profile_kernels.py OUT.json -- bench step --workload criteo26 --no-naive

Runs the command (any `tilecore` arguments after `--`) under `jax.profiler` with a
Perfetto trace, then sums the duration of every event on the accelerator's timelines
by name (kernels, copies, memsets) and prints the top 25 with their share and call
count; OUT.json holds the top 40. Compilation and warm-up calls are included (as are
the autotuner's kernels on a GPU): keep `--repeats` and `--warmup` small and read the
shares, not the totals. On the CPU backend there is no device timeline and the table
is empty. Profile before optimising: issue 13's GPU figures started from this table.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

import jax

from tilecore_apps.cli import main as tilecore


def device_time(trace: Path) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Microseconds and calls per event name on the trace's device timelines."""
    data = json.loads(gzip.decompress(trace.read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    time: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices:
            time[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    return time, calls


def run(out: Path, args: list[str]) -> int:
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python frames would swamp the trace
    with tempfile.TemporaryDirectory(prefix="tilecore-profile-") as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True, profiler_options=options)
        try:
            status = tilecore(args)
        finally:
            jax.profiler.stop_trace()
        traces = sorted(Path(tmp).rglob("*.trace.json.gz"))
        if not traces:
            raise RuntimeError(f"jax.profiler wrote no Perfetto trace under {tmp}")
        time, calls = device_time(traces[-1])
    total = sum(time.values())
    rows = [{"name": name, "us": us, "calls": calls[name], "share": us / total}
            for name, us in time.most_common(40)]
    print(f"device time {total / 1e3:.1f} ms over {sum(calls.values())} events "
          f"({jax.devices()[0].device_kind})")
    for r in rows[:25]:
        print(f"{r['us'] / 1e3:9.2f} ms {100 * r['share']:5.1f}% {r['calls']:6d}  "
              f"{r['name'][:100]}")
    out.write_text(json.dumps({"command": args, "status": status, "device_us": total,
                               "device": jax.devices()[0].device_kind, "top": rows},
                              indent=1) + "\n")
    return status


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit(__doc__)
    sys.exit(run(Path(sys.argv[1]), sys.argv[3:]))
