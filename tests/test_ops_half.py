"""Half-precision tables (bfloat16, float16) with stochastic rounding on update.

- The rounding itself, bit for bit against the numpy oracle (`reference_stochastic_round`,
  written from the definition in float64) on random values of every range, and the
  hash of its random bits against `reference_rounding_bits`.
- Unbiasedness: the mean of many roundings of one value is that value within a 6σ
  bound that round-to-nearest and truncation miss by far; through the ops, updates
  of a quarter of a unit in the last place add up where round-to-nearest stagnates.
- The ops on both kernel paths against the float32 oracle, each step from the
  device's own state: activations to float32 precision, tables within one unit in
  the last place of their format (the bound of one stochastic rounding: `eps` ·
  2^⌊log2|x|⌋, `half_ulp_gap`), slots (float32) to float32 precision, untouched rows
  bit-unchanged.
- Reproducibility (same seed: bit-identical), and a 2-device mesh in a subprocess.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tilecore as tc
from _ops_cases import Case, assert_close, initial_slots, preprocess, shard_slots, table
from tilecore import ops
from tilecore.ops._rounding import Rounding, rounding_bits, rounding_key, stochastic_round
from tilecore.testing import (
    half_ulp_gap,
    reference_lookup,
    reference_lookup_grad,
    reference_rounding_bits,
    reference_row_gradients,
    reference_stochastic_round,
)

HALF = (jnp.bfloat16, jnp.float16)
AXIS = "sparsecore"


def _half(spec: tc.TableSpec, dtype: Any) -> tc.TableSpec:
    return dataclasses.replace(spec, weights_dtype=dtype)


# bfloat16 a and b stack (dims 13 and 15 pad to 16: one 16-lane vector per row in the CPU
# kernels); float16 c (20 pads to 24: a vector and 8 single lanes), bfloat16 e (single lanes
# only) and float32 d stand alone. The 16-bit tables take a rule with a slot (Adagrad) and
# one without (SGD): the fused kernels' 16-bit reads and writes are the same for every rule,
# whose arithmetic is float32 (the rules themselves are checked in test_ops); each rule and
# format is a kernel compiled of its own (~5 CPU-s each on a fresh clone).
MIXED = Case(
    "half-mixed",
    (_half(table("a", 61, 13, "mean", limits=5), jnp.bfloat16),
     _half(table("b", 35, 15, "mean", limits=4), jnp.bfloat16),
     _half(table("c", 40, 20, optimizer=tc.SGD(learning_rate=0.3)), jnp.float16),
     table("d", 30, 8, optimizer=tc.Adam(learning_rate=0.01)),
     _half(table("e", 25, 3, "sqrtn", optimizer=tc.SGD(learning_rate=0.2)), jnp.bfloat16)),
    (("fa0", "a", 32), ("fa1", "a", 32), ("fb", "b", 32), ("fc", "c", 32), ("fd", "d", 32),
     ("fe", "e", 32)),
    weighted=("fa1", "fb", "fc"), allow_id_dropping=True, seed=11,
)


def _bits(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, shape, dtype=np.uint64).astype(
        np.uint32)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical 16-bit arrays (any NaN equal to any NaN)."""
    nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return bool(np.all((a.view(np.uint16) == b.view(np.uint16)) | nan))


# --- the rounding against its oracle --------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_rounding_matches_oracle_bit_for_bit(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    scales = (1.0, 1e-3, 6e-5, 1e-6, 1e-8, 3e4, 1e30, 1e-39)  # normal, f16 subnormal, huge
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519, 65520, 65535, 65536,
                3.3e38, -3.4e38, 1e-45, 2**-14, -(2**-14), 2**-24, 2**-25, 3 * 2**-26]
    x = np.concatenate([rng.normal(0, s, 4000) for s in scales] + [specials]).astype(np.float32)
    bits = _bits(x.shape, 1)
    got = np.asarray(jax.jit(lambda a, b: stochastic_round(a, dtype, b))(x, bits))
    assert got.dtype == np.dtype(dtype)
    assert _same(got, reference_stochastic_round(x, dtype, bits))
    # Always one of the two neighbours: within one gap, never further.
    finite = np.isfinite(got.astype(np.float32))
    err = np.abs(got[finite].astype(np.float64) - x[finite].astype(np.float64))
    assert np.all(err < half_ulp_gap(x[finite], dtype))


def test_rounding_bits_match_oracle() -> None:
    seed, rows = 2**40 + 12345, np.array([0, 1, 7, 2**31 - 1])
    key = rounding_key(seed, "stack", jnp.int32(9))
    got = np.asarray(rounding_bits(Rounding(key, 100), jnp.asarray(rows, jnp.int32), 5))
    np.testing.assert_array_equal(got, reference_rounding_bits(seed, "stack", 9, rows + 100, 5))
    # Another device (row offset), step, seed or stack: other bits.
    for seed2, stack, step, offset in ((seed, "stack", 9, 101), (seed, "stack", 10, 100),
                                       (seed + 1, "stack", 9, 100), (seed, "other", 9, 100)):
        other = reference_rounding_bits(seed2, stack, step, rows + offset, 5)
        assert np.mean(other == got) < 0.1


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("magnitude", [1.0, -3.0e-3, 2.0e-6])  # 2e-6: float16 subnormal
def test_rounding_is_unbiased(dtype: Any, magnitude: float) -> None:
    """x = lo + 0.3·gap: the mean of 2^20 roundings is x within 6σ (σ = gap·√(p(1-p)/n)
    ≈ 0.00045 gap), while round-to-nearest and truncation are 0.3 gap off."""
    gap = float(half_ulp_gap(np.float32(magnitude), dtype))
    lo = float(np.asarray(magnitude, np.float32).astype(dtype).astype(np.float64))
    x = np.float32(lo + 0.3 * gap * np.sign(magnitude))
    n = 2**20
    rounded = np.asarray(stochastic_round(jnp.full((n,), x), dtype, jnp.asarray(_bits((n,), 2))))
    values = rounded.astype(np.float64)
    assert set(np.unique(values)) <= {lo, lo + gap * np.sign(magnitude)}
    bound = 6 * gap * np.sqrt(0.3 * 0.7 / n)
    assert abs(values.mean() - float(x)) < bound
    for biased in (np.float32(x).astype(dtype), np.float32(lo).astype(dtype)):  # RN, truncation
        assert abs(float(biased) - float(x)) > 100 * bound


# --- through the ops ------------------------------------------------------------------------


def _accumulate(dtype: Any, seed: int, steps: int = 32, devices: int = 1, mesh: Any = None
                ) -> np.ndarray:
    """`steps` SGD updates of a quarter gap each on a table of ones (every row touched
    once per step); the per-table result as float64."""
    vocab, dim = 256, 8
    spec = tc.TableSpec(name="t", vocab_size=vocab, embedding_dim=dim, weights_dtype=dtype,
                        optimizer=tc.SGD(learning_rate=1.0))
    plan = tc.plan_stacking([tc.FeatureSpec(name="f", table=spec, input_shape=(vocab, 1))],
                            tc.Topology(global_devices=devices, sc_per_device=2))
    batch, _ = tc.preprocess(plan, {"f": tc.Ragged.from_rows([[i] for i in range(vocab)])})
    tables = ops.shard(plan, {"t": np.ones((vocab, dim), np.float32)})
    variables = {name: ops.EmbeddingVariables(jnp.asarray(t, dtype)) for name, t in tables.items()}
    if mesh is not None:
        variables = {n: ops.EmbeddingVariables(jax.device_put(
            v.table, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS))))
            for n, v in variables.items()}
    grads = {"f": jnp.full((vocab, dim), -0.25 * float(half_ulp_gap(1.0, dtype)))}
    options = ops.UpdateOptions(rounding_seed=seed)
    update = jax.jit(lambda v, s: ops.lookup_grad(plan, batch, v, grads, s, mesh=mesh,
                                                  options=options), donate_argnums=0)
    for step in range(steps):
        variables = update(variables, jnp.int32(step))
    assert all(v.table.dtype == dtype for v in variables.values())
    return ops.unshard(plan, {n: v.table for n, v in variables.items()})["t"].astype(np.float64)


@pytest.mark.parametrize("dtype", HALF)
def test_small_updates_add_up(dtype: Any, kernels: str) -> None:
    """32 updates of +gap/4 from 1.0: the mean is 1 + 8 gaps within 6σ (σ ≈ 0.054 gap
    over 2048 values); round-to-nearest would leave every value at 1.0."""
    del kernels  # both settings: the CPU kernels read and write 16-bit rows themselves
    gap = float(half_ulp_gap(1.0, dtype))
    values = _accumulate(dtype, seed=3)
    assert abs((values.mean() - 1.0) / gap - 8.0) < 6 * np.sqrt(32 * 0.25 * 0.75 / values.size)
    assert np.all(np.abs(values - 1.0) / gap == np.round(np.abs(values - 1.0) / gap))


def test_same_seed_same_tables() -> None:
    first, again = _accumulate(jnp.bfloat16, seed=5, steps=4), _accumulate(jnp.bfloat16, 5, 4)
    np.testing.assert_array_equal(first, again)
    other = _accumulate(jnp.bfloat16, seed=6, steps=4)
    assert np.mean(first == other) < 0.9


def _half_run(case: Case, devices: int = 1, steps: int = 3, mesh: Any = None, seed: int = 0
              ) -> list[dict[str, Any]]:
    """Per step: activations, and every stack's `[table, *slots]` before and after the
    jitted, donated `lookup_grad` (tables as float32: exact for half precision)."""
    plan = case.plan(devices)
    place: Any = jnp.asarray if mesh is None else (lambda x: jax.device_put(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS))))
    tables, slots = ops.shard(plan, case.table_values()), shard_slots(plan, initial_slots(plan))
    variables = {n: ops.EmbeddingVariables(place(tables[n].astype(s.weights_dtype)),
                                           tuple(map(place, slots[n])))
                 for n, s in plan.stacks.items()}
    forward = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh))
    backward = jax.jit(lambda b, v, g, s: ops.lookup_grad(
        plan, b, v, g, s, mesh=mesh, options=ops.UpdateOptions(rounding_seed=seed)),
        donate_argnums=1)

    def state(variables: Any) -> dict[str, list[np.ndarray]]:
        for name, v in variables.items():
            assert v.table.dtype == plan.stacks[name].weights_dtype
            assert all(s.dtype == np.float32 for s in v.slots)
        return {n: [np.asarray(v.table, np.float32), *map(np.asarray, v.slots)]
                for n, v in variables.items()}

    out = []
    for step in range(steps):
        batch, _ = preprocess(plan, *case.batch(step))
        activations = {f: np.asarray(a) for f, a in forward(batch, variables).items()}
        before = state(variables)
        variables = backward(batch, variables, case.activation_grads(step), jnp.int32(step))
        out.append({"activations": activations, "before": before, "after": state(variables)})
    return out


def _per_table(plan: tc.StackingPlan, stacked: dict[str, list[np.ndarray]], k: int
               ) -> dict[str, np.ndarray]:
    """Array k (0: table, 1..: slots) of every stack as per-table arrays."""
    return ops.unshard(plan, {s: a[k] if k < len(a) else a[0] for s, a in stacked.items()})


def check_half_against_oracle(case: Case, run: list[dict[str, Any]], devices: int = 1) -> None:
    """Each step from the device's own state: activations to float32 precision, tables
    within one gap of the float32 oracle, slots to float32 precision, untouched rows
    bit-unchanged."""
    plan = case.plan(devices)
    for step, seen in enumerate(run):
        inputs, weights = case.batch(step)
        grads = case.activation_grads(step)
        tables = _per_table(plan, seen["before"], 0)
        slots = {t: tuple(_per_table(plan, seen["before"], 1 + k)[t]
                          for k in range(len(spec.optimizer.slot_names)))
                 for t, spec in plan.tables.items()}
        for f, want in reference_lookup(plan, inputs, weights, tables).items():
            assert_close(seen["activations"][f], want, f"{f} at step {step}")
        new_tables, new_slots = reference_lookup_grad(plan, inputs, weights, tables, slots,
                                                      grads, step)
        got = _per_table(plan, seen["after"], 0)
        for name, want in new_tables.items():
            dtype = plan.tables[name].weights_dtype
            want = np.asarray(want, np.float64)
            slack = 1e-5 * max(1.0, float(np.abs(want).max()))  # float32 arithmetic
            bound = (half_ulp_gap(want, dtype) if dtype != np.float32 else 0.0) + slack
            err = np.abs(got[name].astype(np.float64) - want)
            assert np.all(err <= bound), (name, step, float((err - bound).max()))
            for k, want_slot in enumerate(new_slots[name]):
                assert_close(_per_table(plan, seen["after"], 1 + k)[name], want_slot,
                             f"slot {k} of {name} at step {step}")
        touched = reference_row_gradients(plan, inputs, weights, grads)
        mask = ops.shard(plan, {n: np.isin(np.arange(s.vocab_size), list(touched[n]))[:, None]
                                * np.ones((1, s.embedding_dim), np.float32)
                                for n, s in plan.tables.items()})
        for stack, hit in mask.items():
            untouched = ~hit.any(axis=1)
            for old, new in zip(seen["before"][stack], seen["after"][stack], strict=True):
                np.testing.assert_array_equal(new[untouched].view(np.uint32),
                                              old[untouched].view(np.uint32))


def test_plan_keeps_dtypes_apart() -> None:
    plan = MIXED.plan()
    dtypes = {s.table_names: s.weights_dtype.name for s in plan.stacks.values()}
    assert dtypes == {("a", "b"): "bfloat16", ("c",): "float16", ("d",): "float32",
                      ("e",): "bfloat16"}


def test_explicit_groups_of_two_dtypes_are_refused() -> None:
    x = _half(table("x", 20, 8), jnp.bfloat16)
    y = table("y", 20, 8)
    features = [tc.FeatureSpec(name=f"f{t.name}", table=t, input_shape=(8, 2)) for t in (x, y)]
    with pytest.raises(ValueError, match=r"Cannot stack table 'y' with 'x': weights_dtype "
                                         r"differs \(float32 vs bfloat16\)"):
        tc.stack_tables(features, tc.Topology(sc_per_device=2), (("x", "y"),))
    assert len(tc.plan_stacking(features, tc.Topology(sc_per_device=2)).stacks) == 2


def test_ops_match_float32_oracle(kernels: str) -> None:
    del kernels
    check_half_against_oracle(MIXED, _half_run(MIXED))


def test_cpu_kernels_serve_half_tables(kernels: str) -> None:
    """Under ffi the half stacks' lookup and update call the 16-bit CPU kernels."""
    plan = MIXED.plan()
    batch, _ = preprocess(plan, *MIXED.batch(0))
    variables = ops.init_tables(plan, jax.random.key(0))
    grads = {f: jnp.asarray(g) for f, g in MIXED.activation_grads(0).items()}
    text = (jax.jit(lambda b, v: ops.lookup(plan, b, v)).lower(batch, variables).as_text()
            + jax.jit(lambda b, v: ops.lookup_grad(plan, b, v, grads, 0)).lower(
                batch, variables).as_text())
    calls = set(re.findall(r"custom_call @(tilecore_\w+)", text))
    if kernels == "xla":
        assert not calls, calls
        return
    for suffix in ("bf16", "f16"):
        assert f"tilecore_lookup_buffers_{suffix}" in calls, calls
        assert any(c.startswith("tilecore_fused_update_buffers_") and c.endswith(f"_{suffix}")
                   for c in calls), calls


def _rowwise_adagrad(grad: Any, row: Any, accumulator: Any, learning_rate: Any
                     ) -> tuple[Any, Any]:
    """Adagrad on the row's squared norm: reduces along the row, so no fused kernel."""
    accumulator = accumulator + (grad * grad).sum(axis=-1, keepdims=True)
    return row - learning_rate * grad / (accumulator ** 0.5), accumulator + 0 * grad


ROWWISE = tc.CustomOptimizer(update_fn=_rowwise_adagrad, learning_rate=0.1,
                             slot_initial_value_tuple=(0.2,))
UNFUSED = Case(
    "half-unfused",
    (_half(table("a", 50, 20, optimizer=ROWWISE), jnp.bfloat16),
     _half(table("b", 30, 5, "mean", optimizer=ROWWISE), jnp.float16)),
    (("fa", "a", 32), ("fb", "b", 32)), weighted=("fb",), seed=12,
)


def test_a_rule_without_fused_kernel(kernels: str) -> None:
    """The rule in JAX on chunks of 16-bit rows gathered and scattered by the kernels."""
    del kernels
    from tilecore.ops.cpu._fused_update import fused_kernels

    assert fused_kernels(ROWWISE, jnp.bfloat16, 16) is None
    check_half_against_oracle(UNFUSED, _half_run(UNFUSED, steps=2))


@pytest.mark.parametrize("dtype", HALF)
def test_cpu_rounding_matches_oracle_bit_for_bit(dtype: Any) -> None:
    """The fused CPU update's per-value restatement of the rounding (`_round16`)."""
    from tilecore.ops.cpu import _round16
    from tilecore.ops.cpu._vector import BFLOAT16, FLOAT16

    source_format = BFLOAT16 if dtype == jnp.bfloat16 else FLOAT16
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(0, s, 500) for s in (1.0, 1e-3, 6e-5, 1e-6, 1e-8, 3e4)]
                       + [[0.0, -0.0, np.inf, -np.inf, np.nan, 65519, 65520, 3.3e38, 1e-45,
                           2**-24, 3 * 2**-26]]).astype(np.float32)
    bits = _bits(x.shape, 4)
    got = np.array([_round16.narrow(v, source_format, np.uint64(b)) for v, b in zip(x, bits, strict=True)],
                   np.uint16).view(dtype)
    assert _same(got, reference_stochastic_round(x, dtype, bits))
    back = np.array([_round16.widen(v, source_format) for v in got.view(np.uint16)], np.float32)
    finite = np.isfinite(back)
    np.testing.assert_array_equal(back[finite], got.astype(np.float32)[finite])
    seed, rows = 2**40 + 5, np.array([0, 3, 2**31 + 7])
    key = int(np.asarray(rounding_key(seed, "s", jnp.int32(2))))
    want = reference_rounding_bits(seed, "s", 2, rows, 4)
    got_bits = [[_round16.value_bits(key, int(r), d) for d in range(4)] for r in rows]
    np.testing.assert_array_equal(np.asarray(got_bits, np.uint64), want)


@pytest.mark.parametrize("dtype", HALF)
def test_wings_write_the_same_bits(dtype: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One step of the CPU kernels' fused update and of XLA's, from the same state: the
    same rows rounded the same way (a float32 rule result differing in its last bit may
    round differently, so 99% bit-identical, every value within one gap)."""
    from tilecore.ops._backend import wing

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernels run on the CPU backend only")
    case = dataclasses.replace(MIXED, tables=tuple(
        _half(t, dtype) if t.weights_dtype != np.float32 else t for t in MIXED.tables))
    plan = case.plan()
    batch, _ = preprocess(plan, *case.batch(0))
    grads = {f: jnp.asarray(g) for f, g in case.activation_grads(0).items()}
    variables = ops.init_tables(plan, jax.random.key(1))
    after = {}
    for setting in ("ffi", "xla"):
        monkeypatch.setenv("TILECORE_KERNELS", setting)
        wing.cache_clear()
        step = jax.jit(lambda b, v, s: ops.lookup_grad(plan, b, v, grads, s))
        after[setting] = {n: np.asarray(v.table) for n, v in step(batch, variables, 3).items()}
    monkeypatch.undo()
    wing.cache_clear()
    for name, spec in plan.stacks.items():
        if spec.weights_dtype == np.float32:
            continue
        cpu, xla = after["ffi"][name], after["xla"][name]
        assert np.mean(cpu.view(np.uint16) == xla.view(np.uint16)) > 0.99, name
        wide = xla.astype(np.float64)
        assert np.all(np.abs(cpu.astype(np.float64) - wide) <= half_ulp_gap(wide, dtype)), name


def test_a_float32_table_for_a_half_stack_is_refused() -> None:
    plan = MIXED.plan()
    tables = ops.shard(plan, MIXED.table_values())
    variables = {n: ops.EmbeddingVariables(jnp.asarray(t), tuple(map(jnp.asarray, s)))
                 for (n, t), s in zip(tables.items(), shard_slots(plan, initial_slots(plan)).values(),
                                      strict=True)}
    batch, _ = preprocess(plan, *MIXED.batch(0))
    stack = plan.table_settings["a"].stack_name
    with pytest.raises(ValueError, match=rf"Stack '{stack}': the table is float32 but .*bfloat16"):
        ops.lookup(plan, batch, variables)


def test_init_tables_in_the_stack_dtype() -> None:
    plan = MIXED.plan()
    variables = ops.init_tables(plan, jax.random.key(0))
    for name, spec in plan.stacks.items():
        assert variables[name].table.dtype == spec.weights_dtype
        assert all(s.dtype == np.float32 for s in variables[name].slots)


# --- several devices (a subprocess with 2 CPU devices) --------------------------------------


def worker(out: Path) -> None:
    assert jax.device_count() == 2, jax.devices()
    mesh = jax.make_mesh((2,), (AXIS,))
    run = _half_run(MIXED, 2, mesh=mesh)
    arrays = {f"{t}/{kind}/{stack}/{k}": a for t, seen in enumerate(run)
              for kind in ("before", "after") for stack, arrays in seen[kind].items()
              for k, a in enumerate(arrays)}
    arrays.update({f"{t}/act/{f}": a for t, seen in enumerate(run)
                   for f, a in seen["activations"].items()})
    np.savez(out / "mixed.npz", **arrays)
    again = _half_run(MIXED, 2, mesh=mesh)
    np.savez(out / "again.npz", **{f"{t}/{s}": a[0] for t, seen in enumerate(again)
                                   for s, a in seen["after"].items()})
    np.save(out / "accumulate.npy", _accumulate(jnp.bfloat16, 3, 32, devices=2, mesh=mesh))
    from tilecore.ops._backend import wing

    assert wing().name == {"ffi": "cpu", "xla": "xla"}[os.environ["TILECORE_KERNELS"]]


@pytest.fixture(scope="module", params=["ffi", "xla"])
def two_devices(request: pytest.FixtureRequest,
                made_once: Callable[[str, Callable[[Path], object]], Path]) -> Path:
    """The worker's results on a 2-device mesh with the CPU kernels (ffi) or XLA's."""
    def run(out: Path) -> None:
        env = dict(os.environ, JAX_PLATFORMS="cpu", TILECORE_KERNELS=request.param,
                   XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""),
                                       "--xla_force_host_platform_device_count=2"]))
        done = subprocess.run([sys.executable, __file__, str(out)], env=env, text=True,
                              capture_output=True, timeout=600, check=False)
        assert done.returncode == 0, f"worker failed:\n{done.stdout}\n{done.stderr}"

    return made_once(f"ops-half-two-devices-{request.param}", run)


def _load_run(path: Path) -> list[dict[str, Any]]:
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    run: list[dict[str, Any]] = [{"activations": {}, "before": {}, "after": {}}
                                 for _ in range(1 + max(int(k.split("/")[0]) for k in arrays))]
    for key in sorted(arrays, key=lambda k: (len(k), k)):
        parts = key.split("/")
        seen = run[int(parts[0])]
        if parts[1] == "act":
            seen["activations"][parts[2]] = arrays[key]
        else:
            seen[parts[1]].setdefault(parts[2], []).append(arrays[key])
    return run


def test_two_devices_match_oracle(two_devices: Path) -> None:
    check_half_against_oracle(MIXED, _load_run(two_devices / "mixed.npz"), devices=2)


def test_two_devices_reproducible(two_devices: Path) -> None:
    run = _load_run(two_devices / "mixed.npz")
    with np.load(two_devices / "again.npz") as again:
        for key in again.files:
            step, stack = key.split("/")
            np.testing.assert_array_equal(again[key], run[int(step)]["after"][stack][0])


def test_two_devices_draw_their_own_bits(two_devices: Path) -> None:
    """Every row starts equal and gets equal updates: the two devices' shards differ
    (their rows draw their own bits), and the mean is unbiased as on one device."""
    values = np.load(two_devices / "accumulate.npy")
    gap = float(half_ulp_gap(1.0, jnp.bfloat16))
    assert abs((values.mean() - 1.0) / gap - 8.0) < 6 * np.sqrt(32 * 0.25 * 0.75 / values.size)
    ids = np.arange(len(values))  # partition id mod 4: 0, 1 on device 0, 2, 3 on device 1
    first, second = values[ids % 4 < 2], values[ids % 4 >= 2]
    assert np.mean(first == second) < 0.5


def test_bad_dtype_names_the_table() -> None:
    with pytest.raises(ValueError, match=r"TableSpec 'emb': weights_dtype must be one of "
                                         r"float32, bfloat16, float16 .*int8"):
        tc.TableSpec(name="emb", vocab_size=8, embedding_dim=4, weights_dtype=jnp.int8)
    with pytest.raises(ValueError, match=r"weights_dtype=.float64"):
        tc.TableSpec(name="emb", vocab_size=8, embedding_dim=4, weights_dtype="float64")
    spec = tc.TableSpec(name="emb", vocab_size=8, embedding_dim=4, weights_dtype="bfloat16")
    assert spec.weights_dtype == jnp.bfloat16 == ml_dtypes.bfloat16


def test_bad_rounding_seed() -> None:
    for seed in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="rounding_seed must be an integer"):
            ops.UpdateOptions(rounding_seed=seed)  # type: ignore[arg-type]
    assert ops.UpdateOptions(rounding_seed=np.uint64(2**63)).rounding_seed == 2**63


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
