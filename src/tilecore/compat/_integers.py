"""Integer fields of compat specs, read strictly: a float is refused, never truncated.

`int(63.5)` is 63: a compat `TableSpec(vocabulary_size=63.5)` used to become a
63-row table, and `64.0` passed only because it happened to be whole. The
reference refuses a float limit or vocabulary when it prepares the specs (its
C++ binding raises `RuntimeError`) and a float width when it creates the
variables (JAX raises `TypeError`); `NotAnIntegerError` is both, with a message
that names the spec, the field and the value.
"""

from __future__ import annotations

import operator
from typing import Any


class NotAnIntegerError(TypeError, RuntimeError):
    """An integer field of a spec holds a float, a string or another non-integer.

    A `TypeError` (JAX's type for a float shape) and a `RuntimeError` (the type the
    reference's preprocessing binding raises for a float size or limit).
    """


def whole(owner: str, field: str, value: Any) -> int:
    """`value` as an `int` when it is an integer (`int`, `bool`, a NumPy integer).

    Raises:
      NotAnIntegerError: for anything else (e.g. `64.0`), naming `owner` and `field`.
    """
    try:
        return operator.index(value)
    except TypeError:
        hint = (f" Write {field}={int(value)}." if isinstance(value, float) and value.is_integer()
                else "")
        raise NotAnIntegerError(
            f"{owner}: {field} must be an integer, got {value!r} ({type(value).__name__}).{hint}"
        ) from None
