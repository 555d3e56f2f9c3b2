"""The storage dtype of a table's values: float32, or a half format to halve the bytes.

Host-side (numpy and ml_dtypes only, no JAX): `jnp.bfloat16` *is* `ml_dtypes.bfloat16`,
so a spec built with JAX's names and one built in a data-loader worker compare equal.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

WEIGHTS_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
"""The storage formats a table may use: float32 (default), bfloat16, float16."""

FLOAT32 = WEIGHTS_DTYPES[0]


def weights_dtype(value: Any, owner: str) -> np.dtype:
    """`value` (`jnp.bfloat16`, `np.float16`, `"bfloat16"`, a dtype, ...) as one of
    `WEIGHTS_DTYPES`; raises naming `owner` for anything else."""
    names = ", ".join(d.name for d in WEIGHTS_DTYPES)
    try:
        dtype: np.dtype | None = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in WEIGHTS_DTYPES:
        raise ValueError(
            f"{owner}: weights_dtype must be one of {names} (e.g. jnp.bfloat16), got "
            f"weights_dtype={value!r}. Tables are stored in one of these formats; activations, "
            "gradients and optimizer slots are float32 whatever the table's format.")
    return dtype


def is_half(dtype: Any) -> bool:
    """True for the 16-bit storage formats (bfloat16, float16)."""
    return np.dtype(dtype) in WEIGHTS_DTYPES[1:]
