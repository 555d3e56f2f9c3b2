"""Evaluation metrics on the host (numpy): ROC AUC with ties, and log loss."""

from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties count ½.

    Rank-based (Mann–Whitney U): with average ranks over tied scores,
    `AUC = (Σ ranks of positives − P(P+1)/2) / (P·N)`, in O(n log n).
    Labels are 0/1 (or booleans); both classes must be present.
    """
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"auc: labels {y.shape} and scores {s.shape} must have the same shape.")
    if not np.all(np.isfinite(s)):
        raise ValueError("auc: scores contain NaN or Inf; evaluate a finite model.")
    positive = y.astype(bool)
    if y.size and not np.all((y == 0) | (y == 1)):
        raise ValueError(f"auc: labels must be 0 or 1, got values {np.unique(y)[:5]}.")
    num_pos = int(positive.sum())
    num_neg = y.size - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError(f"auc: needs both classes, got {num_pos} positives and {num_neg} "
                         "negatives; evaluate on more samples.")
    order = np.argsort(s, kind="stable")
    sorted_scores = s[order]
    # Tie groups: [start, end) runs of equal scores; each gets the mean of ranks start+1..end.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], s.size]
    ranks = np.empty(s.size, np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    u = ranks[positive].sum() - num_pos * (num_pos + 1) / 2.0
    return float(u / (num_pos * num_neg))


def log_loss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of `sigmoid(logits)` against 0/1 `labels` (stable form)."""
    y = np.asarray(labels, np.float64).reshape(-1)
    z = np.asarray(logits, np.float64).reshape(-1)
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))
