"""The reference's core constants (`jax_tpu_embedding.sparsecore.lib.core.constants`)."""

from ....preprocessing._packed import FILLER_ID

PADDING_VALUE: int = int(FILLER_ID)
"""Filler for the unused entries of the COO ID buffers (2³¹−1): tilecore's own filler."""

__all__ = ["PADDING_VALUE"]
