"""The CPU wing of the device ops: numba kernels that XLA calls through its typed FFI.

XLA's CPU gathers, scatters and sorts cost 80–300 ns per row; these loops do the
same work at memory speed. `WING` is what `tilecore.ops._backend` hands the shared
ops when `unavailable_reason()` is None on the CPU backend.
"""

from ._ffi import unavailable_reason as unavailable_reason
from ._wing import WING as WING

__all__ = ["WING", "unavailable_reason"]
