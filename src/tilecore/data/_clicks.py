"""A synthetic click dataset with a learnable signal: labels from a hidden model.

Every categorical feature draws Zipf-skewed IDs (one per sample, or 1..max_ids
for a multi-hot feature); a few dense features are standard normal. The label of
a sample is Bernoulli(sigmoid(logit)) with the hidden logit

    logit = bias + a·Σ_f pooled_f / √F + b·(dense · v) / √D + c·pooled_0·pooled_1,

where `pooled_f` is the mean of a hidden per-ID weight `w_f[id]` ~ N(0, 1) over the
sample's IDs of feature f. A model with embeddings and a dense part can learn
it: the hot IDs are seen often, the pairwise term rewards feature interactions.
Everything is a pure function of `(seed, step)` (numpy only, no JAX).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np

from ..preprocessing import Ragged
from ..specs import FeatureSpec, TableSpec
from ..specs._numbers import is_integer
from ._workload import IdDistribution, Workload

EVAL_STEP_OFFSET = 1 << 40
"""Held-out batch i is generated as step `EVAL_STEP_OFFSET + i`: never a training step."""
_HIDDEN_STEP = 1 << 41  # the "step" that seeds the hidden model
_DENSE_KEY, _LABEL_KEY = 1 << 30, (1 << 30) + 1  # never a feature index


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClickFeature:
    """One categorical feature of the click data, and the table it looks up.

    Attributes:
      name: feature name.
      vocab_size: IDs are in `[0, vocab_size)` (the rows of its table).
      max_ids: IDs per sample: 1 for one-hot, else uniform in `[1, max_ids]`.
      exponent: Zipf exponent of the IDs (larger: more skewed).
      table: the name of the table it looks up; None: a table of its own, named as
        the feature. Features that name one table share its rows (and so need the
        same `vocab_size`; see `click_feature_specs`).
    """

    name: str
    vocab_size: int
    max_ids: int = 1
    exponent: float = 1.1
    table: str | None = None

    def __post_init__(self) -> None:
        if not (is_integer(self.vocab_size) and is_integer(self.max_ids)) or (
                self.vocab_size < 1 or self.max_ids < 1):
            raise ValueError(
                f"ClickFeature {self.name!r}: vocab_size and max_ids must be integers >= 1, "
                f"got vocab_size={self.vocab_size!r}, max_ids={self.max_ids!r}."
            )
        if self.table is not None and (not isinstance(self.table, str) or not self.table):
            raise ValueError(f"ClickFeature {self.name!r}: table must be a non-empty name or "
                             f"None (a table of its own), got table={self.table!r}.")

    @property
    def table_name(self) -> str:
        """The name of the table it looks up (`table`, else its own name)."""
        return self.table or self.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClickBatch:
    """One batch: ragged IDs per feature, dense features `[B, D]`, labels `[B]` (0 or 1)."""

    sparse: Mapping[str, Ragged]
    dense: np.ndarray
    labels: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.labels)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClickDataset:
    """Deterministic train and held-out click batches with a hidden ground truth.

    Attributes:
      features: the categorical features.
      num_dense: dense features per sample.
      batch_size: samples per batch.
      seed: base seed: IDs, dense values, labels and the hidden model derive from it.
      signal: scale of the hidden logit (larger: labels more predictable).
    """

    features: tuple[ClickFeature, ...]
    num_dense: int = 4
    batch_size: int = 1024
    seed: int = 0
    signal: float = 2.0

    def __post_init__(self) -> None:
        if len(self.features) < 2:
            raise ValueError(f"ClickDataset: need >= 2 features, got {len(self.features)}.")
        if self.num_dense < 1 or self.batch_size < 1:
            raise ValueError(
                f"ClickDataset: num_dense and batch_size must be >= 1, got "
                f"num_dense={self.num_dense}, batch_size={self.batch_size}."
            )

    @functools.cached_property
    def _workload(self) -> Workload:
        specs, dists = [], []
        for k, f in enumerate(self.features):
            table = TableSpec(name=f.name, vocab_size=f.vocab_size, embedding_dim=1)
            specs.append(FeatureSpec(name=f.name, table=table,
                                     input_shape=(self.batch_size, f.max_ids)))
            dists.append(IdDistribution.scattered(
                table, exponent=f.exponent, min_ids=1, max_ids=f.max_ids, seed=(self.seed, k)))
        return Workload(name="clicks", features=tuple(specs), distributions=tuple(dists),
                        batch_size=self.batch_size, seed=self.seed)

    @functools.cached_property
    def hidden_weights(self) -> dict[str, np.ndarray]:
        """Feature → the hidden per-ID weights `[vocab]` of the ground-truth model."""
        return {
            f.name: np.random.default_rng((self.seed, _HIDDEN_STEP, k))
            .standard_normal(f.vocab_size).astype(np.float32)
            for k, f in enumerate(self.features)
        }

    @functools.cached_property
    def hidden_dense(self) -> np.ndarray:
        """The hidden weights `[num_dense]` of the dense features."""
        key = (self.seed, _HIDDEN_STEP, _DENSE_KEY)
        return np.random.default_rng(key).standard_normal(self.num_dense).astype(np.float32)

    def hidden_logits(self, sparse: Mapping[str, Ragged], dense: np.ndarray) -> np.ndarray:
        """The ground-truth logit of every sample (what the labels are drawn from)."""
        pooled = [_mean_per_row(self.hidden_weights[f.name], sparse[f.name])
                  for f in self.features]
        s = self.signal
        logit = s * np.sum(pooled, axis=0) / np.sqrt(len(pooled))
        logit += 0.5 * s * (dense @ self.hidden_dense) / np.sqrt(self.num_dense)
        logit += 0.5 * s * pooled[0] * pooled[1]
        return (logit - 1.0).astype(np.float32)

    def train_batch(self, step: int) -> ClickBatch:
        """Training batch `step` (any step can be regenerated alone, in any order)."""
        if step < 0 or step >= EVAL_STEP_OFFSET:
            raise ValueError(f"ClickDataset: step must be in [0, 2**40), got {step=}.")
        return self._batch(step)

    def eval_batch(self, index: int) -> ClickBatch:
        """Held-out batch `index`: drawn like training batches, from other seeds."""
        if index < 0:
            raise ValueError(f"ClickDataset: eval index must be >= 0, got {index=}.")
        return self._batch(EVAL_STEP_OFFSET + index)

    def _batch(self, step: int) -> ClickBatch:
        sparse = self._workload.batch(step)
        dense = np.random.default_rng((self.seed, step, _DENSE_KEY)).standard_normal(
            (self.batch_size, self.num_dense), dtype=np.float32)
        p = 1.0 / (1.0 + np.exp(-self.hidden_logits(sparse, dense)))
        u = np.random.default_rng((self.seed, step, _LABEL_KEY)).random(self.batch_size)
        return ClickBatch(sparse=sparse, dense=dense, labels=(u < p).astype(np.float32))


def _mean_per_row(weights: np.ndarray, ragged: Ragged) -> np.ndarray:
    """Mean of `weights[id]` over each sample's IDs (0 for a sample without IDs)."""
    counts = np.diff(ragged.row_splits)
    rows = np.repeat(np.arange(ragged.num_rows), counts)
    sums = np.bincount(rows, weights=weights[ragged.values], minlength=ragged.num_rows)
    return (sums / np.maximum(counts, 1)).astype(np.float32)


def clicks(
    seed: int = 0,
    batch_size: int = 1024,
    *,
    vocab_sizes: tuple[int, ...] = (1000, 5000, 20_000, 50_000, 100_000, 2000, 10_000, 500),
    multi_hot: Mapping[int, int] | None = None,
    num_dense: int = 4,
    signal: float = 2.0,
) -> ClickDataset:
    """The built-in click data: feature k (`c00`, `c01`, …) on a table of `vocab_sizes[k]`.

    `multi_hot` maps feature index → max IDs per sample (default: features 2 and
    5 hold 1..8 IDs; the rest are one-hot). Exponents spread over [1.05, 1.3].
    """
    multi_hot = {2: 8, 5: 8} if multi_hot is None else dict(multi_hot)
    count = len(vocab_sizes)
    bad = sorted(k for k in multi_hot if not 0 <= k < count)
    if bad:
        raise ValueError(f"clicks: multi_hot names features {bad}, but there are {count}.")
    features = tuple(
        ClickFeature(name=f"c{k:02d}", vocab_size=v, max_ids=multi_hot.get(k, 1),
                     exponent=1.05 + 0.25 * ((3 * k) % count) / max(count - 1, 1))
        for k, v in enumerate(vocab_sizes)
    )
    return ClickDataset(features=features, num_dense=num_dense, batch_size=batch_size,
                        seed=seed, signal=signal)
