"""The XLA typed-FFI route that the FFI test modules exercise (`tilecore.ops.cpu._ffi`).

Importing this skips the importing test module where numba or JAX cannot provide the
route (too old or missing: the route is optional); `skip_without_route` skips a test where
this process's XLA refuses it.
"""

from __future__ import annotations

import pytest

try:
    from tilecore.ops.cpu import _ffi
except Exception as error:  # numba/jax too old or missing: the FFI route is optional
    pytest.skip(f"tilecore.ops.cpu._ffi cannot be imported: {error}", allow_module_level=True)

__all__ = ["_ffi", "skip_without_route"]


def skip_without_route() -> None:
    """Skip the calling test (or fixture) unless the FFI route works in this process."""
    reason = _ffi.unavailable_reason()
    if reason is not None:
        pytest.skip(f"XLA typed-FFI route unavailable: {reason}")
