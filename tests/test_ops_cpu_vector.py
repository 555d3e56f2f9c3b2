"""The CPU kernels' row arithmetic (`ops/cpu/_vector`): 16-lane vector operations give the
same bits as the scalar loop they replace, at every width and offset, and touch nothing
outside the row."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilecore.ops.cpu._vector import (
    TABLE_FORMATS,
    add_scaled,
    add_scaled_from,
    copy_table,
    row_address,
)


@numba.njit(cache=False)
def _add_scaled_rows(out, rows, gains, src, picks):
    for i in range(rows.shape[0]):
        add_scaled(row_address(out, rows[i]), row_address(src, picks[i]), gains[i],
                   src.shape[1])


@numba.njit(cache=False)
def _scalar_rows(out, rows, gains, src, picks):
    for i in range(rows.shape[0]):
        for d in range(src.shape[1]):
            out[rows[i], d] += gains[i] * src[picks[i], d]


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 70), entries=st.integers(0, 40), seed=st.integers(0, 2**31))
def test_add_scaled_equals_the_scalar_loop_bit_for_bit(width: int, entries: int,
                                                       seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((9, width)).astype(np.float32)
    start = rng.standard_normal((7, width)).astype(np.float32)
    rows = rng.integers(0, 7, entries).astype(np.int32)  # repeated rows accumulate in order
    picks = rng.integers(0, 9, entries).astype(np.int32)
    gains = rng.standard_normal(entries).astype(np.float32)
    vector, scalar = start.copy(), start.copy()
    _add_scaled_rows(vector, rows, gains, src, picks)
    _scalar_rows(scalar, rows, gains, src, picks)
    np.testing.assert_array_equal(vector, scalar)


@numba.njit(cache=False)
def _add_scaled_from_rows(out, rows, gains, src, picks, source_format):
    for i in range(rows.shape[0]):
        add_scaled_from(row_address(out, rows[i]), row_address(src, picks[i]), gains[i],
                        out.shape[1], source_format)


# The widths with straight-line code (16, 32), their neighbours, and longer rows.
@settings(max_examples=40, deadline=None)
@given(width=st.sampled_from([1, 15, 16, 17, 31, 32, 33, 48, 64, 70]),
       dtype=st.sampled_from(sorted(TABLE_FORMATS, key=str)), seed=st.integers(0, 2**31))
def test_add_scaled_from_equals_the_widened_scalar_loop(width: int, dtype: np.dtype,
                                                        seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((9, width)).astype(dtype)
    start = rng.standard_normal((7, width)).astype(np.float32)
    rows = rng.integers(0, 7, 30).astype(np.int32)
    picks = rng.integers(0, 9, 30).astype(np.int32)
    gains = rng.standard_normal(30).astype(np.float32)
    vector, scalar = start.copy(), start.copy()
    bits = values if dtype == np.float32 else values.view(np.uint16)
    _add_scaled_from_rows(vector, rows, gains, bits, picks, TABLE_FORMATS[dtype][1])
    _scalar_rows(scalar, rows, gains, values.astype(np.float32), picks)
    np.testing.assert_array_equal(vector, scalar)


@numba.njit(cache=False)
def _add_scaled_at(out, offset, src, gain, width):
    add_scaled(out.ctypes.data + 4 * offset, src.ctypes.data, gain, width)


@pytest.mark.parametrize("width", [1, 15, 16, 17, 32, 33, 48])
def test_add_scaled_writes_only_its_run(width: int) -> None:
    # A run that starts one float into the array (unaligned), with sentinels either side.
    out = np.full(width + 2, 7.0, np.float32)
    src = np.arange(width, dtype=np.float32)
    _add_scaled_at(out, 1, src, np.float32(2.0), width)
    np.testing.assert_array_equal(out[1:width + 1], 7.0 + 2.0 * src)
    assert out[0] == 7.0 and out[width + 1] == 7.0



@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (64, 17)])
def test_copy_table_copies_every_element_and_nothing_else(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(shape[0])
    source = rng.normal(size=shape).astype(np.float32)
    buffer = np.full((shape[0] + 2, shape[1]), -7.0, np.float32)
    copy_table(buffer[1:-1], source)  # a C-contiguous block of rows inside a bigger array
    np.testing.assert_array_equal(buffer[1:-1], source)
    assert (buffer[0] == -7.0).all() and (buffer[-1] == -7.0).all()
