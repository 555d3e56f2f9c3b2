"""The built-in workloads: Criteo-like, multi-hot, and a shared-table stacking mix."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..specs import FeatureSpec, TableSpec
from ..specs._numbers import is_integer
from ._workload import IdDistribution, Workload


def _feature(
    name: str, table: TableSpec, batch_size: int, *, exponent: float, ids: tuple[int, int],
    seed: int, salt: int,
) -> tuple[FeatureSpec, IdDistribution]:
    """A feature on `table` drawing `ids[0]..ids[1]` IDs per sample (map seeded by seed, salt)."""
    spec = FeatureSpec(name=name, table=table, input_shape=(batch_size, ids[1]))
    dist = IdDistribution.scattered(
        table, exponent=exponent, min_ids=ids[0], max_ids=ids[1], seed=(seed, salt)
    )
    return spec, dist


def _workload(
    name: str, pairs: Sequence[tuple[FeatureSpec, IdDistribution]], batch_size: int, seed: int
) -> Workload:
    return Workload(
        name=name, features=tuple(f for f, _ in pairs), distributions=tuple(d for _, d in pairs),
        batch_size=batch_size, seed=seed,
    )


def _spread(k: int, count: int, stride: int, lo: float = 1.05, hi: float = 1.2) -> float:
    """Exponent of table k: [lo, hi] visited in the order k·stride mod count (not by size)."""
    return lo + (hi - lo) * ((k * stride) % count) / (count - 1)


def _vocabs(lo: float, hi: float, count: int) -> list[int]:
    return [int(v) for v in np.rint(np.geomspace(lo, hi, count))]


CRITEO_MULTI_HOT = (5, 13, 21)
"""Features of `criteo` with 20–100 IDs per sample; the others have one."""


def criteo(seed: int = 0, batch_size: int = 16384) -> Workload:
    """Criteo-like click logs: 26 features, each on its own table (dim 16, sum).

    Vocabularies are `np.geomspace(1e3, 4e6, 26)` rounded (feature k on table k).
    Table k's IDs are Zipf with exponent `1.05 + 0.15·((7k) mod 26)/25`, so skew
    and size are not correlated. Features 5, 13 and 21 hold a uniform 20–100 IDs
    per sample (about 60); the other 23 hold one. About 203 IDs per sample.
    """
    pairs = []
    for k, vocab in enumerate(_vocabs(1e3, 4e6, 26)):
        table = TableSpec(name=f"t{k:02d}", vocab_size=vocab, embedding_dim=16)
        ids = (20, 100) if k in CRITEO_MULTI_HOT else (1, 1)
        pairs.append(_feature(f"f{k:02d}", table, batch_size, exponent=_spread(k, 26, 7),
                              ids=ids, seed=seed, salt=k))
    return _workload("criteo", pairs, batch_size, seed)


def multihot(seed: int = 0, batch_size: int = 4096) -> Workload:
    """Multi-hot features: 8 tables (dim 64, sum), 200 IDs per sample each.

    Vocabularies are `np.geomspace(1e5, 2e6, 8)` rounded; table k's Zipf exponent
    is `1.05 + 0.15·((3k) mod 8)/7`. 1600 IDs per sample.
    """
    pairs = []
    for k, vocab in enumerate(_vocabs(1e5, 2e6, 8)):
        table = TableSpec(name=f"mh{k}", vocab_size=vocab, embedding_dim=64)
        pairs.append(_feature(f"mh{k}", table, batch_size, exponent=_spread(k, 8, 3),
                              ids=(200, 200), seed=seed, salt=k))
    return _workload("multihot", pairs, batch_size, seed)


# (table, vocab, dim, [(feature, min_ids, max_ids, exponent), ...])
_STACKED_LAYOUT: tuple[tuple[str, int, int, tuple[tuple[str, int, int, float], ...]], ...] = (
    ("item", 2_000_000, 64, (
        ("item_history", 1, 50, 1.05), ("item_cart", 1, 10, 1.1), ("item_target", 1, 1, 1.2),
    )),
    ("geo", 1_000, 16, (("geo", 1, 1, 1.2),)),
    ("device", 10_000, 16, (("device", 1, 1, 1.15),)),
    ("publisher", 100_000, 16, (("publisher", 1, 1, 1.1),)),
    ("campaign", 500_000, 16, (("campaign", 1, 1, 1.05),)),
    ("query_terms", 50_000, 64, (("query_terms", 1, 20, 1.1),)),
    ("category", 200_000, 64, (("category", 1, 5, 1.15),)),
    ("user", 1_000_000, 64, (("user", 1, 1, 1.05),)),
)


def stacked(seed: int = 0, batch_size: int = 16384) -> Workload:
    """Feature and table stacking together: one big shared table plus seven small ones.

    | table       | vocab     | dim | features (IDs per sample, Zipf exponent)               |
    |-------------|-----------|-----|--------------------------------------------------------|
    | item        | 2,000,000 | 64  | item_history (1–50, 1.05), item_cart (1–10, 1.1),      |
    |             |           |     | item_target (1, 1.2)                                   |
    | geo         | 1,000     | 16  | geo (1, 1.2)                                           |
    | device      | 10,000    | 16  | device (1, 1.15)                                       |
    | publisher   | 100,000   | 16  | publisher (1, 1.1)                                     |
    | campaign    | 500,000   | 16  | campaign (1, 1.05)                                     |
    | query_terms | 50,000    | 64  | query_terms (1–20, 1.1)                                |
    | category    | 200,000   | 64  | category (1–5, 1.15)                                   |
    | user        | 1,000,000 | 64  | user (1, 1.05)                                         |

    Valencies are uniform in the given range; about 51 IDs per sample. Each
    feature on `item` has its own scatter map (different hot items per feature).
    """
    pairs = []
    salt = 0
    for table_name, vocab, dim, features in _STACKED_LAYOUT:
        table = TableSpec(name=table_name, vocab_size=vocab, embedding_dim=dim)
        for feature_name, lo, hi, exponent in features:
            pairs.append(_feature(feature_name, table, batch_size, exponent=exponent,
                                  ids=(lo, hi), seed=seed, salt=salt))
            salt += 1
    return _workload("stacked", pairs, batch_size, seed)


CRITEO26_VOCABS = (
    4_000_000, 2_000_000, 1_000_000, 1_000_000, 500_000, 500_000, 200_000, 200_000,
    *(100_000,) * 4, *(50_000,) * 4, *(10_000,) * 4, *(1_000,) * 6,
)


def criteo26(seed: int = 0, batch_size: int = 4096) -> Workload:
    """The training workload: 26 features, each on its own table (dim 32, sum, unit weights).

    Vocabularies (feature k on table k): 4e6, 2e6, 1e6, 1e6, 5e5, 5e5, 2e5, 2e5,
    then 1e5 ×4, 5e4 ×4, 1e4 ×4, 1e3 ×6. Features 0–19 hold one ID per sample,
    20–25 a uniform 1–40. Every table's IDs are Zipf with exponent 1.1, scattered
    by a fixed random map per table.
    """
    pairs = []
    for k, vocab in enumerate(CRITEO26_VOCABS):
        table = TableSpec(name=f"c{k:02d}", vocab_size=vocab, embedding_dim=32)
        ids = (1, 40) if k >= 20 else (1, 1)
        pairs.append(_feature(f"c{k:02d}", table, batch_size, exponent=1.1, ids=ids,
                              seed=seed, salt=k))
    return _workload("criteo26", pairs, batch_size, seed)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "criteo": criteo,
    "multihot": multihot,
    "stacked": stacked,
    "criteo26": criteo26,
}
"""Built-in workloads by name: `factory(seed=0, batch_size=...) -> Workload`."""


def get_workload(name: str, **kwargs: int) -> Workload:
    """The built-in workload `name`, built with `kwargs` (e.g. `seed`, `batch_size`)."""
    if name not in WORKLOADS:
        raise ValueError(f"Unknown workload {name!r}; choose one of {sorted(WORKLOADS)}.")
    seed = kwargs.get("seed", 0)
    if not is_integer(seed) or seed < 0:
        raise ValueError(f"get_workload: seed must be an integer >= 0, got {seed!r}.")
    return WORKLOADS[name](**kwargs)
