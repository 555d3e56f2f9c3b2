"""NumPy's scalars as the plain Python numbers that specs hold."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def plain(value: Any) -> Any:
    """`value` as a Python int or float when it is an integer or real number of another
    type (NumPy's `int64`, `float32`, ...), else `value` unchanged (bools too).

    Specs hold plain numbers so that a size computed with NumPy (`ids.max() + 1`) is
    accepted wherever an int is, and prints, hashes and serialises as the number it is.
    """
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer, Python's or NumPy's (a bool is not): the one test of
    the counts, steps, seeds and indices the library is handed."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def make_plain(spec: object, *names: str) -> None:
    """Replace the fields `names` of the frozen dataclass `spec` by their `plain` values
    (a tuple or list field element by element)."""
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, tuple | list):
            value = type(value)(plain(v) for v in value)
        object.__setattr__(spec, name, plain(value))
