"""The split and variadic kernels of the XLA typed-FFI route (`tilecore.ops.cpu._ffi`):
a kernel run in parts on XLA's threads, a kernel taking any number of results or operands
for its last spec, and a part's failure becoming an XLA error."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from _ffi_route import _ffi, skip_without_route  # skips this module without the route

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


@pytest.fixture(scope="module", autouse=True)
def _ffi_available() -> None:
    skip_without_route()


def test_a_split_kernel_runs_every_part_once_on_the_pools_threads() -> None:
    import numba

    @numba.njit
    def stamp(x: Any, out: Any, part: int, parts: int) -> int:
        for row in range(out.shape[0] * part // parts, out.shape[0] * (part + 1) // parts):
            out[row, 0], out[row, 1] = part, parts
        return 0

    kernel = _ffi.register_kernel("test_split_stamp", stamp, [(np.float32, 1)],
                                  [(np.int32, 2)], split=True)
    out = np.asarray(jax.jit(lambda x: kernel(
        x, results=[jax.ShapeDtypeStruct((64, 2), jnp.int32)])[0])(jnp.zeros(1)))
    parts = int(out[0, 1])
    assert (out[:, 1] == parts).all()
    expected = np.concatenate([np.full(64 * (k + 1) // parts - 64 * k // parts, k)
                               for k in range(parts)])
    np.testing.assert_array_equal(out[:, 0], expected)  # every part once, in its own rows
    if (os.cpu_count() or 1) > 1:
        assert parts > 1  # XLA's pool has several threads: the tasks' path ran


@pytest.mark.parametrize("split", [False, True])
def test_a_variadic_kernel_writes_every_result_it_is_asked_for(split: bool) -> None:
    import numba

    from tilecore.ops.cpu._ffi_abi import _voidptr

    @numba.njit
    def fill(x: Any, count: Any, outputs: Any, part: int = 0, parts: int = 1) -> int:
        count[0] = outputs.shape[0]
        for k in range(outputs.shape[0]):
            rows, width = outputs[k, 1], outputs[k, 2]
            view = numba.carray(_voidptr(outputs[k, 0]), (rows, width), np.float32)
            for r in range(rows * part // parts, rows * (part + 1) // parts):
                for c in range(width):
                    view[r, c] = x[0] + 100 * k + 10 * r + c
        return 0

    name = f"test_variadic_{'split' if split else 'serial'}"
    kernel = _ffi.register_kernel(name, fill, [(np.float32, 1)],
                                  [(np.int32, 1), (np.float32, 2)], split=split,
                                  variadic="results")
    shapes = [(5, 3), (1, 7), (64, 2)]
    for n in (1, 3):  # one handler serves any number of results
        results = [jax.ShapeDtypeStruct((1,), jnp.int32),
                   *(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes[:n])]
        count, *outs = jax.jit(lambda x, results=results: kernel(x, results=results))(
            jnp.ones(1))
        assert int(count[0]) == n
        for k, (out, (rows, width)) in enumerate(zip(outs, shapes, strict=False)):
            expected = 1 + 100 * k + 10 * np.arange(rows)[:, None] + np.arange(width)
            np.testing.assert_array_equal(np.asarray(out), expected.astype(np.float32))
    with pytest.raises(TypeError, match="at least 2 results"):
        kernel(jnp.ones(1), results=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    with pytest.raises(TypeError, match="result 2 must be float32 of rank 2"):
        kernel(jnp.ones(1), results=[jax.ShapeDtypeStruct((1,), jnp.int32),
                                     jax.ShapeDtypeStruct((2, 2), jnp.float32),
                                     jax.ShapeDtypeStruct((2,), jnp.float32)])


@pytest.mark.parametrize("split", [False, True])
def test_a_kernel_variadic_in_its_operands_reads_every_one(split: bool) -> None:
    import numba

    from tilecore.ops.cpu._ffi_abi import _voidptr

    @numba.njit
    def totals(scale: Any, inputs: Any, out: Any, part: int = 0, parts: int = 1) -> int:
        for k in range(out.shape[0] * part // parts, out.shape[0] * (part + 1) // parts):
            out[k] = 0.0
            if k < inputs.shape[0]:
                rows, width = inputs[k, 1], inputs[k, 2]
                view = numba.carray(_voidptr(inputs[k, 0]), (rows, width), np.float32)
                for r in range(rows):
                    for c in range(width):
                        out[k] += scale[0] * view[r, c]
        return 0

    name = f"test_variadic_operands_{'split' if split else 'serial'}"
    kernel = _ffi.register_kernel(name, totals, [(np.float32, 1), (np.float32, 2)],
                                  [(np.float32, 1)], split=split, variadic="operands")
    rng = np.random.default_rng(0)
    for shapes in ([(3, 4)], [(3, 4), (1, 1), (50, 2)]):  # one handler, any number of operands
        arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
        out = jax.jit(lambda *xs: kernel(
            jnp.full(1, 2.0), *xs, results=[jax.ShapeDtypeStruct((8,), jnp.float32)])[0])(
                *arrays)
        expected = np.zeros(8, np.float32)
        expected[:len(arrays)] = [2 * a.sum() for a in arrays]
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5)
    with pytest.raises(TypeError, match="at least 2 operands"):
        kernel(jnp.ones(1), results=[jax.ShapeDtypeStruct((8,), jnp.float32)])
    with pytest.raises(TypeError, match="operand 2 must be float32 of rank 2"):
        kernel(jnp.ones(1), jnp.ones((2, 2)), jnp.ones(2),
               results=[jax.ShapeDtypeStruct((8,), jnp.float32)])


@pytest.mark.parametrize("failure", ["raises", "rejects"])
def test_a_failing_part_of_a_split_kernel_becomes_an_xla_error(failure: str) -> None:
    import numba

    @numba.njit
    def picky(x: Any, out: Any, part: int, parts: int) -> int:
        out[part % out.shape[0]] = x[0]
        if x[0] > 0 and part == parts - 1:
            if failure == "raises":
                raise ValueError("positive")
            return 1
        return 0

    kernel = _ffi.register_kernel(f"test_split_{failure}", picky, [(np.float32, 1)],
                                  [(np.float32, 1)], split=True)
    call = jax.jit(lambda x: kernel(x, results=[jax.ShapeDtypeStruct((64,), jnp.float32)])[0])
    jax.block_until_ready(call(-jnp.ones(1)))
    message = "kernel raised" if failure == "raises" else "kernel (raised or )?rejected"
    with pytest.raises(Exception, match=f"test_split_{failure}: {message}"):
        jax.block_until_ready(call(jnp.ones(1)))
