"""PNG plots of a run (matplotlib, Agg backend): loss and AUC over steps, partition load."""

from __future__ import annotations

from .._plot import png as _png
from .._plot import pyplot as _pyplot
from ._summary import TrainSummary


def plot_curves(summary: TrainSummary) -> bytes:
    """Training loss per step and held-out loss; held-out AUC on a second panel.

    The x axis is the global step: a run resumed from step k plots steps k + 1 on, as
    its held-out evaluations (`EvalPoint.step`) are numbered.
    """
    plt = _pyplot()
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    first = summary.start_step + 1
    steps = range(first, first + len(summary.train_losses))
    ax_loss.plot(steps, summary.train_losses, color="tab:blue", alpha=0.35, linewidth=0.8,
                 label="train (per step)")
    window = max(1, len(summary.train_losses) // 20)
    if window > 1:
        kernel = [1.0 / window] * window
        import numpy as np

        smooth = np.convolve(summary.train_losses, kernel, mode="valid")
        ax_loss.plot(range(first + window - 1, first + len(summary.train_losses)), smooth,
                     color="tab:blue",
                     label=f"train (mean of {window})")
    eval_steps = [e.step for e in summary.evals]
    ax_loss.plot(eval_steps, [e.loss for e in summary.evals], "o-", color="tab:orange",
                 label="held-out")
    ax_loss.set(xlabel="step", ylabel="binary cross-entropy", title="loss")
    ax_loss.legend(fontsize=8)
    ax_auc.plot(eval_steps, [e.auc for e in summary.evals], "o-", color="tab:green")
    ax_auc.axhline(0.5, color="gray", linestyle="--", linewidth=1)
    ax_auc.set(xlabel="step", ylabel="ROC AUC", title="held-out AUC")
    return _png(fig)


def plot_partition_load(summary: TrainSummary) -> bytes:
    """Per stack: each partition's max IDs per step (max and mean over steps) vs the limit."""
    plt = _pyplot()
    names = list(summary.partition_load)
    cols = min(2, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 2.6 * rows + 0.5), squeeze=False,
                             constrained_layout=True)
    for k, ax in enumerate(axes.flat):
        if k >= len(names):
            ax.set_axis_off()
            continue
        load = summary.partition_load[names[k]]
        x = list(range(len(load["max"])))
        ax.bar(x, load["max"], color="tab:blue", alpha=0.6, label="max over steps")
        ax.plot(x, load["mean"], "o", color="tab:orange", markersize=3, label="mean")
        ax.axhline(load["limit"], color="tab:red", linestyle="--", linewidth=1, label="limit")
        short = names[k] if len(names[k]) <= 40 else names[k][:37] + "..."
        ax.set_title(short, fontsize=8)
        ax.set_xlabel("partition", fontsize=7)
        ax.set_ylabel("IDs", fontsize=7)
        ax.tick_params(labelsize=7)
        if k == 0:
            ax.legend(fontsize=7)
    fig.suptitle("IDs per partition and step (after FDO tuning)", fontsize=9)
    return _png(fig)
