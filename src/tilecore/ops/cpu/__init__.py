"""The CPU wing of the device ops: numba kernels that XLA calls through its typed FFI.

XLA's CPU gathers, scatters and sorts cost 80–300 ns per row; these loops do the
same work at memory speed. `WING` is what `tilecore.ops._backend` hands the shared
ops when `unavailable_reason()` is None on the CPU backend.

Half-precision tables (bfloat16, float16) are read and written as 16-bit values: the
kernels see them as uint16 and widen rows to float32 in vector registers while pooling
(`_vector.add_scaled_from`); the fused update widens each value, applies the rule in
float32 and writes it back with stochastic rounding (`_round16`, the rule of
`tilecore.ops._rounding` restated per value and checked bit for bit against it).
"""

from ._ffi import unavailable_reason as unavailable_reason
from ._wing import WING as WING

__all__ = ["WING", "unavailable_reason"]
