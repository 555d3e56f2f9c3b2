"""matplotlib for the commands' PNG files: the Agg backend (no display), figures to bytes."""

from __future__ import annotations

import io
from typing import Any


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (imported on first use: it is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig: Any) -> bytes:
    """`fig` as PNG bytes (100 dpi); the figure is closed."""
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    pyplot().close(fig)
    return out.getvalue()
