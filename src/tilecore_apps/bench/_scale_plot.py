"""The PNG of `tilecore bench scale --plot`: step time against vocabulary and IDs per batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._plot import png, pyplot


def plot_scale(result: Mapping[str, Any]) -> bytes:
    """PNG bytes, two panels: ms per step against vocabulary size (log x; unique IDs per
    batch on a second axis; the sizes the memory budget skipped marked), and against IDs
    per batch (log-log, with a dashed line proportional to the IDs through the largest
    point)."""
    plt = pyplot()
    fig, (ax_vocab, ax_ids) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    vocab, ids = result["vocab_sweep"], result["ids_sweep"]
    if vocab is None:
        _not_run(ax_vocab, "vocabulary sweep not run")
    else:
        points = vocab["points"]
        ax_vocab.plot([p["vocab_size"] for p in points], [p["step_ms"] for p in points], "o-",
                      color="tab:blue", label="measured")
        for k, size in enumerate(vocab["skipped_vocab_sizes"]):
            ax_vocab.axvline(size, color="tab:red", linestyle=":", linewidth=1,
                             label="over the memory budget" if k == 0 else None)
        ax_vocab.set_xscale("log")
        ax_vocab.set_ylim(bottom=0)
        ax_vocab.set(xlabel="vocabulary size (rows)", ylabel="ms per step",
                     title=f"{vocab['ids_per_batch']:,} IDs per batch")
        ax_vocab.legend(fontsize=8, loc="upper left")
        if points:  # the rows a step touches grow with the vocabulary (Zipf IDs)
            ax_unique = ax_vocab.twinx()
            ax_unique.plot([p["vocab_size"] for p in points],
                           [p["unique_ids_per_batch"] for p in points], "s--", color="gray",
                           markersize=4, linewidth=1, label="unique IDs per batch")
            ax_unique.set_ylim(bottom=0)
            ax_unique.set_ylabel("unique IDs per batch", color="gray")
            ax_unique.legend(fontsize=8, loc="lower right")
    if ids is None:
        _not_run(ax_ids, "IDs sweep not run")
    else:
        points = ids["points"]
        x = [p["ids_per_batch"] for p in points]
        y = [p["step_ms"] for p in points]
        ax_ids.plot(x, y, "o-", color="tab:green", label="measured")
        ax_ids.plot(x, [y[-1] * n / x[-1] for n in x], "--", color="gray", linewidth=1,
                    label="proportional to IDs")
        ax_ids.set_xscale("log")
        ax_ids.set_yscale("log")
        ax_ids.set(xlabel="IDs per batch", ylabel="ms per step",
                   title=f"vocabulary {ids['vocab_size']:,}")
        ax_ids.legend(fontsize=8)
    backend, kind = result["backend"], result["device_kind"]
    device = backend if kind == backend else f"{backend} ({kind})"
    fig.suptitle(f"fused training step ({result['optimizer']}, dim {result['dim']}, batch "
                 f"{result['batch_size']}) on {device}, host {result['cpu_model']}", fontsize=9)
    return png(fig)


def _not_run(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
