"""The pure-XLA wing of the device ops: plain JAX ops, on every backend.

Gathers, segment sums and a sort-and-segment per-row reduction; XLA fuses them.
`WING` is what `tilecore.ops._backend` hands the shared ops.
"""

from ._wing import WING as WING

__all__ = ["WING"]
