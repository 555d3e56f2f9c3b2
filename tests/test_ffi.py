"""Numba kernels as XLA typed-FFI custom calls (`tilecore.ops.cpu._ffi`).

`python tests/test_ffi.py` prints the benchmark numbers (gather_pool vs XLA, in-place
update, empty-kernel overhead).
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _ffi_route import _ffi, skip_without_route  # skips this module without the route
from _xla_flags import xla_flags

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


@pytest.fixture(scope="module", autouse=True)
def _ffi_available() -> None:
    skip_without_route()


def _random_pool_inputs(rng: np.random.Generator, v: int, d: int, n: int, m: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    table = rng.standard_normal((v, d), dtype=np.float32)
    row = rng.integers(0, v, n).astype(np.int32)
    seg = rng.integers(0, m, n).astype(np.int32)
    seg[rng.random(n) < 0.2] = -1  # skipped entries
    w = rng.standard_normal(n, dtype=np.float32)
    return table, row, seg, w


def _numpy_pool(table: np.ndarray, row: np.ndarray, seg: np.ndarray, w: np.ndarray, m: int
                ) -> np.ndarray:
    out = np.zeros((m, table.shape[1]), np.float64)
    keep = seg >= 0
    np.add.at(out, seg[keep], w[keep, None].astype(np.float64) * table[row[keep]])
    return out


def _xla_pool(table: Any, row: Any, seg: Any, w: Any, m: int) -> Any:
    return jax.ops.segment_sum(table[row] * w[:, None], seg, m)


def test_gather_pool_matches_numpy_and_xla_inside_jit() -> None:
    rng = np.random.default_rng(1)
    table, row, seg, w = _random_pool_inputs(rng, v=1000, d=16, n=20_000, m=300)

    @jax.jit
    def program(table: Any, row: Any, seg: Any, w: Any) -> tuple[Any, Any, Any]:
        # Other XLA ops before and after the custom call, feeding it and consuming it.
        pooled = _ffi.gather_pool(table * 2.0, row, seg, w, 300)
        return pooled, jnp.tanh(pooled) + 1.0, _xla_pool(table * 2.0, row, seg, w, 300)

    pooled, after, xla = (np.asarray(a) for a in program(table, row, seg, w))
    expected = _numpy_pool(2.0 * table, row, seg, w, 300)
    np.testing.assert_allclose(pooled, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pooled, xla, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(after, np.tanh(expected) + 1.0, rtol=1e-5, atol=1e-5)


def test_gather_pool_skips_out_of_range_entries() -> None:
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    row = np.array([0, 9, -3, 1, 2], np.int32)  # 9 and -3 are not rows
    seg = np.array([0, 0, 1, 5, -1], np.int32)  # 5 is not a segment, -1 is padding
    w = np.ones(5, np.float32)
    got = jax.jit(_ffi.gather_pool, static_argnums=4)(table, row, seg, w, 2)
    np.testing.assert_array_equal(np.asarray(got), [table[0], np.zeros(3)])


def test_several_calls_in_one_program_and_in_a_loop() -> None:
    rng = np.random.default_rng(2)
    table, row, seg, w = _random_pool_inputs(rng, v=200, d=8, n=1000, m=50)

    @jax.jit
    def program(table: Any, row: Any, seg: Any, w: Any) -> tuple[Any, Any]:
        a = _ffi.gather_pool(table, row, seg, w, 50)
        b = _ffi.gather_pool(table, row[::-1], seg, w * 3.0, 50)
        updated = _ffi.scatter_add_rows(table, jnp.arange(50, dtype=jnp.int32), a - b)

        def step(_: Any, t: Any) -> Any:  # the kernel inside a while loop
            return _ffi.scatter_add_rows(t, row[:10], jnp.ones((10, 8), jnp.float32))

        return a + b, jax.lax.fori_loop(0, 5, step, updated)

    pooled, looped = program(table, row, seg, w)
    a = _numpy_pool(table, row, seg, w, 50)
    b = _numpy_pool(table, row[::-1], seg, w * 3.0, 50)
    np.testing.assert_allclose(np.asarray(pooled), a + b, rtol=1e-4, atol=1e-4)
    expected = table.astype(np.float64)
    expected[:50] += a - b
    np.add.at(expected, np.tile(row[:10], 5), 1.0)
    np.testing.assert_allclose(np.asarray(looped), expected, rtol=1e-4, atol=1e-4)


def test_scatter_add_rows_without_donation_leaves_input_unchanged() -> None:
    table = jnp.zeros((10, 4), jnp.float32)
    rows = jnp.array([1, 3, 1], jnp.int32)  # duplicates accumulate
    out = jax.jit(_ffi.scatter_add_rows)(table, rows, jnp.ones((3, 4), jnp.float32))
    assert float(jnp.abs(table).sum()) == 0.0
    np.testing.assert_array_equal(np.asarray(out)[:, 0], [0, 2, 0, 1, 0, 0, 0, 0, 0, 0])


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def test_scatter_add_rows_updates_a_donated_table_in_place() -> None:
    v, d, u = 2_000_000, 32, 4096
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.choice(v, u, replace=False).astype(np.int32))
    delta = jnp.asarray(rng.standard_normal((u, d), dtype=np.float32))
    update = jax.jit(_ffi.scatter_add_rows, donate_argnums=0)
    table = jnp.zeros((v, d), jnp.float32)
    address = table.unsafe_buffer_pointer()
    state = {"table": update(table, rows, delta)}  # compile + first call
    assert state["table"].unsafe_buffer_pointer() == address  # the result IS the input buffer

    def call() -> Any:
        state["table"] = update(state["table"], rows, delta)
        return state["table"]

    seconds = _median_seconds(call, repeats=20)
    table = state["table"]
    assert table.unsafe_buffer_pointer() == address
    # 256 MB table: a copy alone takes tens of ms; touching 4096 rows takes ~0.1 ms.
    assert seconds < 5e-3, f"in-place update took {seconds * 1e3:.2f} ms; is the table copied?"
    np.testing.assert_allclose(np.asarray(table[rows]), 21 * np.asarray(delta), rtol=1e-5)
    untouched = np.setdiff1d(np.arange(0, v, 997), np.asarray(rows))
    assert not np.asarray(table[untouched]).any()


def test_bad_operands_raise_instead_of_crashing() -> None:
    with pytest.raises(TypeError, match="operand 1 must be int32"):
        _ffi.scatter_add_rows(jnp.zeros((4, 2)), jnp.zeros(2), jnp.zeros((2, 2)))
    # Straight through jax.ffi, past the Python checks: the handler's own checks answer.
    call = jax.ffi.ffi_call("tilecore_scatter_add_rows", jax.ShapeDtypeStruct((4, 2), jnp.float32))
    cases = [
        ((jnp.zeros((4, 2)), jnp.zeros(2), jnp.zeros((2, 2))), "operand 1 must be a int32"),
        ((jnp.zeros((4, 2)), jnp.zeros(2, jnp.int32)), "wrong number of operands"),
        ((jnp.zeros((4, 2)), jnp.zeros(2, jnp.int32), jnp.zeros((2, 3))), "shape mismatch"),
    ]
    for operands, message in cases:
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(jax.jit(call)(*operands))


def test_a_raising_kernel_becomes_an_xla_error() -> None:
    import numba

    @numba.njit
    def strict_copy(x: Any, out: Any) -> int:
        if x[0] > 0:
            raise ValueError("positive")
        out[:] = x
        return 0

    kernel = _ffi.register_kernel("test_strict_copy", strict_copy, [(np.float32, 1)],
                                  [(np.float32, 1)])
    call = jax.jit(lambda x: kernel(x, results=[jax.ShapeDtypeStruct((3,), jnp.float32)])[0])
    np.testing.assert_array_equal(np.asarray(call(-jnp.ones(3))), -np.ones(3))
    with pytest.raises(Exception, match="test_strict_copy: kernel raised"):
        jax.block_until_ready(call(jnp.ones(3)))


def _output_table(arrays: list[np.ndarray]) -> np.ndarray:
    """What a variadic FFI kernel receives for `arrays`: address, rows, width of each."""
    return np.array([(a.ctypes.data, *a.shape) for a in arrays], np.int64).reshape(-1, 3)


@pytest.mark.parametrize("minibatching", [False, True])
def test_lookup_parts_write_their_own_rows_and_add_up_to_the_whole(minibatching: bool) -> None:
    import tilecore as tc
    from tilecore.ops._activations import feature_slices
    from tilecore.ops._layout import stack_layouts
    from tilecore.ops._per_device import flat_buffers
    from tilecore.ops.cpu import _kernels

    rng = np.random.default_rng(3)
    tables = [tc.TableSpec(name=f"t{i}", vocab_size=v, embedding_dim=d, combiner=c)
              for i, (v, d, c) in enumerate([(50, 16, "sum"), (70000, 16, "mean"),
                                             (60, 12, "sum")])]
    # 70,000 rows of 16 floats: a stack above PREFETCH_TABLE_BYTES, whose rows are prefetched;
    # the table of width 12 stacks with the one of 50 rows (its activations are 12 wide).
    features = [tc.FeatureSpec(name=f"f{i}", table=t, input_shape=(40, 7))
                for i, t in enumerate(tables)]
    plan = tc.stack_tables(features, tc.Topology(global_devices=1, sc_per_device=2),
                           [["t0", "t2"]])
    if minibatching:
        plan = plan.with_config(enable_minibatching=True)
    ids: dict[str, Any] = {f.name: rng.integers(0, f.table.vocab_size, (40, 7))
                           for f in features}
    counts = rng.integers(0, 4, 40)
    counts[::5] = 0  # samples with no IDs: their rows are zeros, written by nothing else
    ids["f2"] = tc.Ragged(rng.integers(0, 60, int(counts.sum())),
                          np.concatenate([[0], np.cumsum(counts)]))
    batch, _ = tc.preprocess(plan, ids)
    for name, layout in stack_layouts(plan).items():
        buffers = [np.asarray(x) for x in flat_buffers(batch.stacks[name])]
        table = rng.standard_normal((layout.rows_per_device, layout.dim)).astype(np.float32)
        operands = (_kernels.layout_array(layout),
                    np.array([0, int(np.max(batch.num_minibatches))], np.int32), *buffers, table)
        rows, s = layout.sc_per_device * layout.samples_per_sc, layout.sc_per_device
        whole = np.full((rows, layout.dim), np.nan, np.float32)
        block = np.array([[0, layout.samples_per_sc]], np.int32)
        assert _kernels._lookup_buffers_kernel(*operands, block, _output_table([whole]), 0, 1) == 0
        assert np.isfinite(whole).all()
        slices = feature_slices(plan, name)
        assert name != "t0_t2" or [w for *_, w in slices.values()] == [16, 12]
        where = np.array([(first, count) for first, count, _ in slices.values()], np.int32)
        blocks = whole.reshape(s, layout.samples_per_sc, layout.dim)
        expected = [blocks[:, first:first + count, :width].reshape(-1, width)
                    for first, count, width in slices.values()]
        for parts in (1, 2, 3, 7):
            out = np.full((rows, layout.dim), np.nan, np.float32)
            features_out = [np.full(e.shape, np.nan, np.float32) for e in expected]
            for part in range(parts):
                _kernels._lookup_buffers_kernel(*operands, block, _output_table([out]), part,
                                                parts)
                done = rows * (part + 1) // parts  # rows past this part's: not yet written
                np.testing.assert_array_equal(out[:done], whole[:done])
                assert np.isnan(out[done:]).all()
                assert _kernels._lookup_buffers_kernel(
                    *operands, where, _output_table(features_out), part, parts) == 0
            for got, want in zip(features_out, expected, strict=True):
                np.testing.assert_array_equal(got, want)
        if name == "t0_t2":  # f2's empty samples: zeros (not the NaN the outputs held)
            assert (expected[1][::5] == 0).all()
        # An output of the wrong size for its slice is refused, not written past; so are
        # slices that overlap (two outputs for one row).
        short = np.zeros((1, layout.dim), np.float32)
        assert _kernels._lookup_buffers_kernel(*operands, block, _output_table([short]), 0, 1) == 1
        twice = np.concatenate([block, block])
        assert _kernels._lookup_buffers_kernel(*operands, twice, _output_table([out, out]), 0,
                                               1) == 1


def test_registration_happens_once_per_process() -> None:
    f32 = np.dtype(np.float32)
    _ffi.GATHER_POOL[f32].ensure_registered()
    handler = _ffi._REGISTERED["tilecore_gather_pool"][1]
    _ffi.GATHER_POOL[f32].ensure_registered()
    module = importlib.reload(_ffi)  # a new FfiKernel object for the same name
    module.GATHER_POOL[f32].ensure_registered()
    assert module._REGISTERED["tilecore_gather_pool"][1] is handler
    clash = module.register_kernel("tilecore_gather_pool", module._gather_pool_kernel,
                                   args=[(np.float64, 2)], rets=[(np.float64, 2)])
    with pytest.raises(ValueError, match="already registered"):
        clash.ensure_registered()


def test_kernel_runs_per_device_inside_shard_map() -> None:
    code = textwrap.dedent("""
        import numpy as np, jax
        from jax.sharding import Mesh, PartitionSpec as P
        from tilecore.ops.cpu import _ffi
        assert _ffi.unavailable_reason() is None, _ffi.unavailable_reason()
        assert len(jax.devices()) == 2, jax.devices()
        mesh = Mesh(np.array(jax.devices()), ("d",))
        rng = np.random.default_rng(0)
        V, D, n, M = 300, 8, 2000, 64
        table = rng.standard_normal((2 * V, D), dtype=np.float32)
        row = rng.integers(0, V, 2 * n).astype(np.int32)
        seg = rng.integers(-1, M, 2 * n).astype(np.int32)
        w = rng.random(2 * n, dtype=np.float32)

        def per_device(t, r, s, w):  # each device pools and updates its own shard
            pooled = _ffi.gather_pool(t, r, s, w, M)
            return pooled, _ffi.scatter_add_rows(t, r[:4], pooled[:4])

        for check_vma in (False, True):
            f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"),) * 4,
                                      out_specs=(P("d"), P("d")), check_vma=check_vma))
            pooled, updated = (np.asarray(x) for x in f(table, row, seg, w))
            for g in range(2):
                t, r = table[g * V:(g + 1) * V], row[g * n:(g + 1) * n]
                s, ww = seg[g * n:(g + 1) * n], w[g * n:(g + 1) * n]
                expected = np.zeros((M, D))
                np.add.at(expected, s[s >= 0], ww[s >= 0, None] * t[r[s >= 0]])
                np.testing.assert_allclose(pooled[g * M:(g + 1) * M], expected, atol=1e-4)
                t = t.astype(np.float64)
                np.add.at(t, r[:4], expected[:4])
                np.testing.assert_allclose(updated[g * V:(g + 1) * V], t, atol=1e-4)
        print("shard_map ok")
    """)
    env = dict(os.environ, XLA_FLAGS=xla_flags(2),
               JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "shard_map ok" in result.stdout


def test_probe_runs_on_a_device_of_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several processes `jax.devices()[0]` belongs to process 0: a probe run there
    failed on every other process, which then silently took the XLA path while process 0
    ran the kernels (mismatched collectives: wrong activations, NaN)."""
    elsewhere = object()  # stands for another process's device: nothing can run on it
    monkeypatch.setattr(jax, "devices", lambda *_, **__: [elsewhere])
    _ffi.unavailable_reason.cache_clear()
    try:
        assert _ffi.unavailable_reason() is None
    finally:
        _ffi.unavailable_reason.cache_clear()


class _MemoryStore:
    """The part of JAX's distributed key-value store the kernel choice uses."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        assert allow_overwrite or key not in self.values
        self.values[key] = value

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        return [(k, v) for k, v in sorted(self.values.items()) if k.startswith(key)]


def test_processes_choosing_different_kernels_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilecore.distributed import _exchange
    from tilecore.ops import _backend

    store = _MemoryStore()
    monkeypatch.setattr(_exchange, "jax_store", lambda: store)
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    for process in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda process=process: process)
        _backend._check_same_choice_as_peers("ffi")
        _backend._check_same_choice_as_peers("ffi")  # deciding again is fine
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    with pytest.raises(RuntimeError, match=(
            r"Process 2 runs the ops with xla \(\$TILECORE_KERNELS=xla\) but process 0 with "
            r"ffi: .* Set \$TILECORE_KERNELS to the same value")):
        _backend._check_same_choice_as_peers("xla ($TILECORE_KERNELS=xla)")
    monkeypatch.setattr(jax, "process_count", lambda: 1)  # one process: nothing to agree on
    _backend._check_same_choice_as_peers("xla ($TILECORE_KERNELS=xla)")


def _benchmark() -> None:
    """Timings for the report: `python tests/test_ffi.py` (prints medians in ms / µs)."""
    import numba

    assert _ffi.unavailable_reason() is None, _ffi.unavailable_reason()
    rng = np.random.default_rng(0)

    # Empty kernel: per-dispatch and per-call (inside a fori_loop) overhead.
    @numba.njit
    def noop(x: Any, out: Any) -> int:
        return 0

    kernel = _ffi.register_kernel("bench_noop", noop, [(np.float32, 1)], [(np.float32, 1)])
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    x = jnp.ones(4, jnp.float32)
    loops = 100_000
    one_ffi = jax.jit(lambda x: kernel(x, results=[spec])[0])
    one_add = jax.jit(lambda x: x + 1.0)
    loop_ffi = jax.jit(lambda x: jax.lax.fori_loop(0, loops, lambda i, c: kernel(
        c, results=[spec])[0], x))
    loop_add = jax.jit(lambda x: jax.lax.fori_loop(0, loops, lambda i, c: c + 1.0, x))
    for f in (one_ffi, one_add, loop_ffi, loop_add):
        jax.block_until_ready(f(x))
    t_one_ffi = _median_seconds(lambda: one_ffi(x), 2000)
    t_one_add = _median_seconds(lambda: one_add(x), 2000)
    t_loop_ffi = _median_seconds(lambda: loop_ffi(x), 10)
    t_loop_add = _median_seconds(lambda: loop_add(x), 10)
    print(f"empty kernel: jit dispatch {t_one_ffi * 1e6:.1f} us (x + 1: {t_one_add * 1e6:.1f} us);"
          f" in a fori_loop {t_loop_ffi / loops * 1e6:.3f} us/call "
          f"(x + 1: {t_loop_add / loops * 1e6:.3f} us/iter)")

    # gather_pool vs pure XLA.
    v, d, n, m = 2_000_000, 32, 600_000, 40_000
    table, row, seg, w = (jnp.asarray(a) for a in _random_pool_inputs(rng, v, d, n, m))
    ffi = jax.jit(_ffi.gather_pool, static_argnums=4)
    xla = jax.jit(_xla_pool, static_argnums=4)
    np.testing.assert_allclose(np.asarray(ffi(table, row, seg, w, m)),
                               np.asarray(xla(table, row, seg, w, m)), rtol=1e-4, atol=1e-4)
    t_ffi = _median_seconds(lambda: ffi(table, row, seg, w, m), 20)
    t_xla = _median_seconds(lambda: xla(table, row, seg, w, m), 20)
    print(f"gather_pool V={v} D={d} n={n} M={m}: ffi {t_ffi * 1e3:.1f} ms, "
          f"XLA segment_sum(table[row]*w) {t_xla * 1e3:.1f} ms ({t_xla / t_ffi:.1f}x)")

    # In-place row update of a donated 2e6 x 32 table vs XLA's donated scatter-add.
    u = 4096
    rows = jnp.asarray(rng.choice(v, u, replace=False).astype(np.int32))
    delta = jnp.asarray(rng.standard_normal((u, d), dtype=np.float32))
    ffi_update = jax.jit(_ffi.scatter_add_rows, donate_argnums=0)
    xla_update = jax.jit(lambda t, r, dl: t.at[r].add(dl, mode="drop", unique_indices=True),
                         donate_argnums=0)
    kept = jax.jit(_ffi.scatter_add_rows)
    for name, update in (("ffi donated", ffi_update), ("XLA donated scatter-add", xla_update)):
        state = {"t": update(table, rows, delta)}
        address = state["t"].unsafe_buffer_pointer()

        def call(update: Any = update, state: dict[str, Any] = state) -> Any:
            state["t"] = update(state["t"], rows, delta)
            return state["t"]

        seconds = _median_seconds(call, 50)
        same = state["t"].unsafe_buffer_pointer() == address
        print(f"scatter_add_rows {u} rows of {v}x{d}, {name}: {seconds * 1e3:.3f} ms "
              f"(same buffer: {same})")
        table = state["t"]
    jax.block_until_ready(kept(table, rows, delta))
    print(f"scatter_add_rows not donated (XLA copies the table first): "
          f"{_median_seconds(lambda: kept(table, rows, delta), 5) * 1e3:.1f} ms")


if __name__ == "__main__":
    _benchmark()


def test_ffi_on_an_accelerator_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilecore.ops._backend import wing

    monkeypatch.setenv("TILECORE_KERNELS", "ffi")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    wing.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"default backend is 'gpu'.*set it to xla"):
            wing()
        monkeypatch.setenv("TILECORE_KERNELS", "auto")
        wing.cache_clear()
        assert wing().name == "xla"  # auto: XLA ops on an accelerator
    finally:
        monkeypatch.undo()
        wing.cache_clear()


def test_handler_cache_key_covers_the_helpers_a_kernel_calls() -> None:
    """numba's cache of a generated handler only watches the handler's file: the key must
    change when a helper the kernel calls changes, or stale machine code runs. The key
    holds the kernel's file and the stamp of all of tilecore's numba sources, which
    covers every module the helpers come from (tests/test_numba_compile_once.py checks
    that the stamp changes with them)."""
    from tilecore._numba import source_stamp
    from tilecore.ops.cpu import _ffi, _kernels, _segments
    from tilecore.preprocessing import _packed

    sources = _ffi._kernel_sources(_kernels._row_gradients_buffers_kernel)
    assert source_stamp() in sources
    assert inspect.getsource(_kernels._row_gradients_buffers_kernel.py_func) in sources[0]
    for helper in (_kernels._buffer_entries, _kernels.entry_in_range, _kernels._aggregate,
                   _segments.next_row, _packed.run_bounds):
        assert "numba" in Path(inspect.getfile(helper.py_func)).read_text(), helper


@pytest.mark.parametrize("damage", ["truncated", "empty", "directory"])
def test_a_damaged_generated_module_is_written_again(tmp_path: Path, damage: str) -> None:
    """The generated handler and fused-update modules are named by a digest of their
    source, so other text there is damage: it failed every later import (a bare
    AttributeError or FileExistsError); it is now replaced, saying so."""
    path = tmp_path / "kernel_0123.py"
    source = "x = 1\n" * 50
    _ffi.write_source(path, source)
    assert path.read_text() == source
    if damage == "directory":
        path.unlink()
        (path / "inside").mkdir(parents=True)
    else:
        path.write_text(source[: len(source) // 2] if damage == "truncated" else "")
    with pytest.warns(RuntimeWarning, match=r"kernel_0123\.py is damaged; writing it again"):
        _ffi.write_source(path, source)
    assert path.read_text() == source
    _ffi.write_source(path, source)  # intact: nothing to say
    assert not list(tmp_path.glob("*.tmp"))


def test_threads_taking_a_rules_kernels_at_once_load_them_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads making their first update at once: one generated and imported the rule's
    module while the others took it half-run from `sys.modules` (AttributeError: no
    `update_buffers`). Loading is one thread at a time, and a failed load leaves nothing
    behind."""
    import threading

    from tilecore.ops.cpu import _fused_update

    inside, most, calls = [0], [0], []

    def register(rule: object, dtype: object) -> object:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        calls.append(rule)
        inside[0] -= 1
        return ("kernels of", rule)

    monkeypatch.setattr(_fused_update, "_register", register)
    monkeypatch.setattr(_fused_update, "_KERNELS", {})
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(
        _fused_update._kernels_for("rule", np.dtype(np.float32))))  # type: ignore[arg-type]
        for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1 and calls == ["rule"] and got == [("kernels of", "rule")] * 4

    import types as pytypes

    def fails() -> None:
        raise SyntaxError("truncated")

    with pytest.raises(SyntaxError):
        _fused_update._run(pytypes.ModuleType("_tilecore_fused_test"), fails)
    assert "_tilecore_fused_test" not in sys.modules


def test_auto_says_when_the_cpu_kernels_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe fails, auto takes XLA's kernels (several times slower): it said
    nothing, so a damaged kernel cache slowed every later process in silence."""
    from tilecore.ops import _backend
    from tilecore.ops import cpu as cpu_wing

    monkeypatch.delenv("TILECORE_KERNELS", raising=False)
    monkeypatch.setattr(cpu_wing, "unavailable_reason", lambda: "the probe failed: test")
    _backend.wing.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"CPU kernels are unavailable \(the probe "
                                                 r"failed: test\); the device ops use XLA's"):
            assert _backend.wing().name == "xla"
    finally:
        _backend.wing.cache_clear()
