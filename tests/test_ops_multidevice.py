"""Device ops over a mesh of 1, 2 and 8 CPU devices: each against the oracle, and
every device count equal to one device.

JAX fixes the device count when it starts, so the ops run in one subprocess started
with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (this file run as a
script). It saves what it saw as `.npz` files; the tests here check them against the
numpy oracle and against each other.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tilecore as tc
from _ops_cases import (
    CASES,
    OPTIMIZERS,
    RICH,
    Case,
    Run,
    assert_close,
    check_against_oracle,
    oracle_steps,
    preprocess,
    run_steps,
    table,
    unshard_state,
)

DEVICES = (1, 2, 8)  # 4 devices: tests/test_compat_ops.py, test_ops_minibatching.py
AXIS = "sparsecore"
MULTI: dict[str, Case] = {
    # One stack (feature + table stacking), Adam, nothing dropped: equal for every G.
    "stacked-adam": dataclasses.replace(
        RICH.with_optimizer("adam", OPTIMIZERS["adam"]), name="stacked-adam",
        allow_id_dropping=False,
        tables=tuple(t.with_limits(max_ids_per_partition=256, max_unique_ids_per_partition=256)
                     for t in RICH.with_optimizer("adam", OPTIMIZERS["adam"]).tables)),
    # Three stacks, three combiners and optimizers (SGD, Adam, FTRL).
    "mixed-no-stacking": CASES["mixed-no-stacking"],
    # Explicit groups, rotation 1, S = 4 (N = 32 at G = 8), IDs dropped: which IDs are
    # dropped depends on G, so only the oracle comparison applies.
    "groups-dropping": CASES["groups-dropping"],
}
EQUAL_ACROSS_DEVICES = ("stacked-adam", "mixed-no-stacking")
def _uniform(key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    import jax

    return jax.random.uniform(key, shape, dtype, minval=-1.0, maxval=1.0)


INIT = Case("init", tuple(dataclasses.replace(t, initializer=_uniform) for t in (
    table("a", 40, 5, optimizer=tc.FTRL(initial_linear_value=0.5)),
    table("b", 9, 3, optimizer=tc.FTRL(initial_linear_value=0.5)))),
    (("fa", "a", 8), ("fb", "b", 8)), sc_per_device=1)
"""Small on purpose: on-device initialisation compiles one program per call whose size
grows with the number of shards."""
INIT_DEVICES = (2, 8)


def _mesh(devices: int) -> Any:
    import jax

    return jax.make_mesh((devices,), (AXIS,))


def _init_arrays(devices: int) -> dict[str, np.ndarray]:
    """init_tables on the mesh (on device and on host) and without one, plus a check
    that the mesh's arrays are row-sharded: device d holds rows [d·S·R, (d+1)·S·R)."""
    import jax

    from tilecore import ops

    plan = INIT.plan(devices)
    assert len(plan.stacks) == 1
    mesh, key = _mesh(devices), jax.random.key(5)
    out: dict[str, np.ndarray] = {}
    for mode, variables in (("mesh", ops.init_tables(plan, key, mesh=mesh)),
                            ("host", ops.init_tables(plan, key, mesh=mesh, on_host=True)),
                            ("none", ops.init_tables(plan, key))):
        for name, v in variables.items():
            for k, array in enumerate((v.table, *v.slots)):
                out[f"{mode}/{name}/{k}"] = np.asarray(array)
                if mode == "none":
                    continue
                rows = array.shape[0] // devices
                shards = sorted(array.addressable_shards, key=lambda s: s.device.id)
                ok = len(shards) == devices and all(
                    s.index[0] == slice(d * rows, (d + 1) * rows) and s.data.shape[0] == rows
                    for d, s in enumerate(shards))
                out[f"sharded/{mode}/{name}/{k}"] = np.asarray(ok)
    return out


def _stacked_arrays(devices: int) -> dict[str, np.ndarray]:
    """`lookup(stacked=True)` over the mesh, unstacked device by device."""
    import jax

    from tilecore import ops

    case = MULTI["stacked-adam"]
    plan = case.plan(devices)
    mesh = _mesh(devices)
    layouts = ops.stack_layouts(plan)
    batch, _ = preprocess(plan, *case.batch(0))
    variables = {n: ops.EmbeddingVariables(jax.numpy.asarray(t)) for n, t in
                 ops.shard(plan, case.table_values()).items()}
    blocks = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh, stacked=True))(
        batch, variables)
    out: dict[str, list[np.ndarray]] = {}
    for name, block in blocks.items():
        per_device = np.asarray(block).reshape(devices, -1, layouts[name].dim)
        for d in range(devices):
            for f, a in ops.unstack_activations(plan, name, per_device[d], layouts[name]).items():
                out.setdefault(f, []).append(np.asarray(a))
    return {f: np.concatenate(parts) for f, parts in out.items()}


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez(path, allow_pickle=False, **arrays)


def worker(out_dir: Path) -> None:
    """Run in the subprocess: every case on every mesh size, saved as npz."""
    import jax

    assert jax.device_count() == 8, jax.devices()
    for name, case in MULTI.items():
        for devices in DEVICES:
            run = run_steps(case, devices, mesh=_mesh(devices))
            _save(out_dir / f"{name}-{devices}.npz", run.to_arrays())
    for devices in INIT_DEVICES:
        _save(out_dir / f"init-{devices}.npz", _init_arrays(devices))
    for devices in DEVICES[1:]:
        _save(out_dir / f"stacked-{devices}.npz", _stacked_arrays(devices))


def _run_worker(out: Path) -> None:
    # Plain XLA ops on every mesh size, one device included (test_ops.py covers the
    # single-device CPU kernels; skipping them here also skips their numba compile).
    env = dict(os.environ, JAX_PLATFORMS="cpu", TILECORE_KERNELS="xla", XLA_FLAGS=" ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip())
    done = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, f"worker failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def results(made_once: Callable[[str, Callable[[Path], object]], Path]) -> Path:
    return made_once("ops-multidevice", _run_worker)


def _load(results: Path, name: str) -> dict[str, np.ndarray]:
    with np.load(results / f"{name}.npz") as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("name", MULTI)
def test_matches_oracle(results: Path, name: str, devices: int) -> None:
    """On G devices: activations, tables, slots equal the oracle's (for this topology),
    untouched rows bit-unchanged, one trace per jitted op for 3 steps."""
    case = MULTI[name]
    run = Run.from_arrays(_load(results, f"{name}-{devices}"))
    assert run.traces == {"lookup": 1, "lookup_grad": 1}
    assert all(run.dropped) == case.allow_id_dropping
    check_against_oracle(case, run, oracle_steps(case, devices), devices)


@pytest.mark.parametrize("devices", DEVICES[1:])
@pytest.mark.parametrize("name", EQUAL_ACROSS_DEVICES)
def test_equals_one_device(results: Path, name: str, devices: int) -> None:
    """Activations, tables and slots on G devices equal one device's, step by step."""
    case = MULTI[name]
    one = Run.from_arrays(_load(results, f"{name}-1"))
    many = Run.from_arrays(_load(results, f"{name}-{devices}"))
    plan_one, plan_many = case.plan(1), case.plan(devices)
    for t in range(len(one.activations)):
        assert many.activations[t].keys() == one.activations[t].keys()
        for f, a in one.activations[t].items():
            assert_close(many.activations[t][f], a, f"{name}: {f} at step {t}")
        want = unshard_state(plan_one, one.after[t])
        got = unshard_state(plan_many, many.after[t])
        for table_name, arrays in want.items():
            assert len(got[table_name]) == len(arrays)
            for k, (x, y) in enumerate(zip(got[table_name], arrays, strict=True)):
                assert_close(x, y, f"{name}: {table_name}[{k}] after step {t}")


@pytest.mark.parametrize("devices", INIT_DEVICES)
def test_init_tables_on_a_mesh(results: Path, devices: int) -> None:
    """Row-sharded over the mesh, and equal on device, on host and without a mesh."""
    arrays = _load(results, f"init-{devices}")
    sharded = {k: bool(v) for k, v in arrays.items() if k.startswith("sharded/")}
    assert sharded and all(sharded.values()), sharded
    for key in (k for k in arrays if k.startswith("none/")):
        rest = key.removeprefix("none/")
        np.testing.assert_array_equal(arrays[f"mesh/{rest}"], arrays[key], rest)
        np.testing.assert_array_equal(arrays[f"host/{rest}"], arrays[key], rest)


@pytest.mark.parametrize("devices", DEVICES[1:])
def test_stacked_lookup_unstacks_per_device(results: Path, devices: int) -> None:
    stacked = _load(results, f"stacked-{devices}")
    run = Run.from_arrays(_load(results, f"stacked-adam-{devices}"))
    assert stacked.keys() == run.activations[0].keys()
    for f, a in stacked.items():
        np.testing.assert_array_equal(a, run.activations[0][f], f)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
