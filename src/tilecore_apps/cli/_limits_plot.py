"""The PNG of `tilecore limits --plot`: per-partition load per stack (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._plot import png, pyplot


def plot_load(results: Sequence[Mapping[str, Any]]) -> bytes:
    """PNG bytes: one subplot per stack (rows) and topology (columns); bars are the
    max over batches of each partition's max IDs, the dots their mean, the dashed
    line the current `max_ids_per_partition` limit (drawn when within 4x of the load)."""
    plt = pyplot()
    names = list(dict.fromkeys(n for r in results for n in r["stacks"]))
    rows, cols = len(names), len(results)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols + 1, 2.6 * rows + 0.6),
                             squeeze=False, constrained_layout=True)
    for c, result in enumerate(results):
        for r, name in enumerate(names):
            ax = axes[r][c]
            stack = result["stacks"].get(name)
            if stack is None:
                ax.set_axis_off()
                continue
            load = stack["per_partition_max_ids"]
            x = list(range(len(load["max"])))
            ax.bar(x, load["max"], color="tab:blue", alpha=0.6, label="max")
            ax.plot(x, load["mean"], "o", color="tab:orange", markersize=3, label="mean")
            limit = stack["current"]["max_ids_per_partition"]
            if limit <= 4 * max(max(load["max"], default=0), 1):
                ax.axhline(limit, color="tab:red", linestyle="--", linewidth=1, label="limit")
            short = name if len(name) <= 40 else name[:37] + "..."
            ax.set_title(f"{result['topology']}: {short}", fontsize=8)
            ax.set_xlabel("partition", fontsize=7)
            if len(x) <= 32:
                ax.set_xticks(x)
            ax.set_ylabel("IDs", fontsize=7)
            ax.tick_params(labelsize=7)
            if r == 0 and c == 0:
                ax.legend(fontsize=7)
    fig.suptitle("max IDs per partition over batches (bars: max, dots: mean)", fontsize=9)
    return png(fig)
