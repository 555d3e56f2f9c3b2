"""Several CPU devices for a benchmark: JAX fixes the device count when it starts.

`--xla_force_host_platform_device_count` only takes effect if it is in
`XLA_FLAGS` before JAX initialises its CPU backend, so a process that finds too
few devices runs the same command again in a child process with the flag set.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from ._signals import handling_signals

RERUN_ENV = "TILECORE_BENCH_RERUN"
_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
_CHILD = "import sys; from tilecore_apps.cli import main; sys.exit(main(sys.argv[1:]))"
CPU_DEVICES_FLOOR = 256
"""The fewest CPU devices `max_cpu_devices` allows, whatever the core count: a mesh as
large as a big accelerator slice's, to try a topology on a laptop."""
CPU_DEVICES_PER_CORE = 4


def max_cpu_devices() -> int:
    """The most CPU devices a command makes with `--xla_force_host_platform_device_count`:
    the larger of `CPU_DEVICES_FLOOR` and `CPU_DEVICES_PER_CORE` per CPU. Simulated devices
    share the host's cores, so past a few per core they add no parallelism, only start-up,
    compilation and per-device buffers (65,536 of them grew a process by 70 MB/s for
    minutes, printing nothing)."""
    return max(CPU_DEVICES_FLOOR, CPU_DEVICES_PER_CORE * (os.cpu_count() or 1))


def check_cpu_devices(count: int) -> None:
    """Raise ValueError, naming --devices and `count`, when `count` is more CPU devices
    than `max_cpu_devices` allows."""
    most = max_cpu_devices()
    if count > most:
        raise ValueError(
            f"--devices {count}: JAX here runs on CPU, where at most {most} devices are "
            f"simulated (the larger of {CPU_DEVICES_FLOOR} and {CPU_DEVICES_PER_CORE} per CPU "
            f"of this machine's {os.cpu_count()}): more add memory and compile time, not "
            "speed. Ask for fewer; on an accelerator, for at most the devices it has.")


def with_device_count(xla_flags: str, count: int) -> str:
    """`xla_flags` with the host device count set to `count` (any earlier value replaced)."""
    kept = _FLAG.sub("", xla_flags).split()
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])


def rerun_with_cpu_devices(count: int, argv: Sequence[str]) -> int:
    """Run `tilecore *argv` in a child process with `count` CPU devices; its exit status.
    ValueError, before any child starts, when the backend is not the CPU, when this is
    already the child, or when `count` is past `max_cpu_devices`."""
    have, backend = jax.device_count(), jax.default_backend()
    if os.environ.get(RERUN_ENV) or backend != "cpu":
        raise ValueError(
            f"--devices {count}: the {backend} backend has only {have} device(s). On CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before starting; on "
            "an accelerator, ask for at most the devices it has."
        )
    check_cpu_devices(count)
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), count)
    env[RERUN_ENV] = "1"
    print(f"this process has {have} CPU device(s); running again with "
          f"XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
    # The child has a session of its own, so that a terminal's Ctrl-C reaches it once,
    # forwarded from here, as do SIGTERM and SIGHUP sent to this process.
    child = subprocess.Popen([sys.executable, "-c", _CHILD, *argv], env=env,
                             start_new_session=True)
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    with handling_signals(forwarded, lambda signum, _: child.send_signal(signum)):
        return child.wait()


def make_mesh(count: int, axis: str) -> Mesh | None:
    """A 1-D mesh over the first `count` devices (None for one device: no mesh needed)."""
    if count == 1:
        return None
    # Explicit axes (jax.make_mesh's default): tilecore.ops reshards inputs onto the mesh.
    return jax.make_mesh((count,), (axis,), devices=jax.devices()[:count])
