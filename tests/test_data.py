"""Built-in synthetic workloads: deterministic, in range, with the documented shapes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import tilecore as tc
from tilecore import data
from tilecore.data._zipf import coprime_multiplier, inverse_cdf_table, sample_ids

SMALL = 64  # samples per batch: divisible by every topology the tests use


@pytest.fixture(params=sorted(data.WORKLOADS))
def workload(request: pytest.FixtureRequest) -> data.Workload:
    return data.get_workload(request.param, batch_size=SMALL)


def test_public_names() -> None:
    for name in data.__all__:
        assert hasattr(data, name), name


def test_batch_is_deterministic_per_seed_and_step(workload: data.Workload) -> None:
    a, b = workload.batch(3), workload.batch(3)
    assert a.keys() == b.keys() == {f.name for f in workload.features}
    for name in a:
        np.testing.assert_array_equal(a[name].values, b[name].values)
        np.testing.assert_array_equal(a[name].row_splits, b[name].row_splits)
    other_step = workload.batch(4)
    other_seed = data.get_workload(workload.name, seed=1, batch_size=SMALL).batch(3)
    assert any(not np.array_equal(a[n].values, other_step[n].values) for n in a)
    assert any(not np.array_equal(a[n].values, other_seed[n].values) for n in a)


def test_threads_do_not_change_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tilecore.data._workload.BLOCK", 1000)  # many blocks per feature
    workload = data.multihot(batch_size=SMALL)
    one, two = workload.batch(2), workload.batch(2, num_threads=2)
    for name in one:
        np.testing.assert_array_equal(one[name].values, two[name].values)


def test_ids_in_range_with_documented_valency(workload: data.Workload) -> None:
    batch = workload.batch(0)
    for feature, dist in zip(workload.features, workload.distributions, strict=True):
        ragged = batch[feature.name]
        assert ragged.values.dtype == np.int32 and ragged.row_splits.dtype == np.int64
        assert ragged.weights is None
        assert ragged.row_splits[0] == 0 and ragged.row_splits[-1] == len(ragged.values)
        lengths = np.diff(ragged.row_splits)
        assert len(lengths) == workload.batch_size == feature.input_shape[0]
        assert lengths.min() >= dist.min_ids and lengths.max() <= dist.max_ids
        assert lengths.max() <= feature.input_shape[1]
        assert ragged.values.min() >= 0
        assert ragged.values.max() < feature.table.vocab_size
    assert data.num_ids(batch) == sum(len(r.values) for r in batch.values())


def test_criteo_layout() -> None:
    w = data.criteo(batch_size=SMALL)
    assert len(w.features) == len(w.tables) == 26
    vocabs = [f.table.vocab_size for f in w.features]
    assert vocabs == [int(v) for v in np.rint(np.geomspace(1e3, 4e6, 26))]
    assert {f.table.embedding_dim for f in w.features} == {16}
    exponents = [d.exponent for d in w.distributions]
    assert min(exponents) == pytest.approx(1.05) and max(exponents) == pytest.approx(1.2)
    multi = [d for d in w.distributions if d.max_ids > 1]
    assert len(multi) == 3 and all((d.min_ids, d.max_ids) == (20, 100) for d in multi)
    assert data.criteo().batch_size == 16384


def test_multihot_and_stacked_layout() -> None:
    mh = data.multihot(batch_size=SMALL)
    assert len(mh.tables) == 8 and {t.embedding_dim for t in mh.tables.values()} == {64}
    assert [t.vocab_size for t in mh.tables.values()][::7] == [100_000, 2_000_000]
    assert all(d.min_ids == d.max_ids == 200 for d in mh.distributions)
    st = data.stacked(batch_size=SMALL)
    assert len(st.tables) == 8
    assert sum(f.table.name == "item" for f in st.features) == 3
    assert st.tables["item"].vocab_size == 2_000_000
    assert {t.embedding_dim for t in st.tables.values()} == {16, 64}


def test_criteo26_layout() -> None:
    w = data.criteo26(batch_size=SMALL)
    vocabs = [f.table.vocab_size for f in w.features]
    assert vocabs == [4_000_000, 2_000_000, 1_000_000, 1_000_000, 500_000, 500_000, 200_000,
                      200_000, *[100_000] * 4, *[50_000] * 4, *[10_000] * 4, *[1_000] * 6]
    assert all(f.table.embedding_dim == 32 and f.table.combiner == "sum" for f in w.features)
    assert all(d.exponent == 1.1 for d in w.distributions)
    assert [(d.min_ids, d.max_ids) for d in w.distributions] == [(1, 1)] * 20 + [(1, 40)] * 6


def test_workloads_plan_and_preprocess() -> None:
    workload = data.stacked(batch_size=SMALL)
    plan = tc.plan_stacking(workload.features, tc.Topology(global_devices=2, sc_per_device=4))
    assert len(plan.stacks) < len(workload.tables)  # table stacking happened
    plan = plan.with_config(allow_id_dropping=True)
    _, stats = tc.preprocess(plan, workload.batch(0), num_threads=1)
    assert set(stats.max_ids_per_partition) == set(plan.stacks)


def test_zipf_frequencies_match_the_law() -> None:
    vocab, s, n = 3_000_000, 1.1, 400_000
    ids = sample_ids(np.random.default_rng(0), n, vocab_size=vocab, exponent=s, multiplier=1,
                     offset=0)
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -s
    p = weights / weights.sum()
    counts = np.bincount(ids, minlength=vocab)
    for rank in (0, 1, 9, 99):
        sigma = math.sqrt(n * p[rank])
        assert abs(counts[rank] - n * p[rank]) < 5 * sigma, rank
    tail = p[2**20 :].sum()  # beyond the exactly summed head
    assert abs((ids >= 2**20).sum() - n * tail) < 5 * math.sqrt(n * tail)


def _numpy_sample_ids(rng: np.random.Generator, n: int, vocab: int, s: float,
                      multiplier: int, offset: int) -> np.ndarray:
    """The draws in numpy ufuncs, step by step (the compiled `_draw`'s oracle): the cell
    from the top 16 bits, the position from the low 16 in the table's dtype, rounded after
    each step, then the rank mapped by a true remainder."""
    start, width = inverse_cdf_table(vocab, s)
    raw = rng.bit_generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
    cell = (raw >> np.uint32(16)).astype(np.intp)
    position = ((raw & np.uint32(0xFFFF)) * 2.0**-16).astype(start.dtype)
    x = start[cell] + position * width[cell]
    return ((x.astype(np.int64) * multiplier + offset) % vocab).astype(np.int32)


@pytest.mark.parametrize(("vocab", "s"), [(1, 1.1), (2, 1.2), (1000, 1.1), (4_000_000, 1.05),
                                          (2**24 + 7, 1.1), (30_000_001, 0.8)])
def test_zipf_draws_equal_the_numpy_oracle(vocab: int, s: float) -> None:
    # float32 tables up to 2**24 rows, float64 beyond; the scatter map's products reach
    # vocab**2, where the compiled remainder's float quotient must still come out exact.
    rng = np.random.default_rng(vocab)
    multiplier = coprime_multiplier(vocab, rng) if vocab > 2 else 1
    offset = int(rng.integers(vocab))
    got = sample_ids(np.random.default_rng(7), 50_001, vocab_size=vocab, exponent=s,
                     multiplier=multiplier, offset=offset)
    want = _numpy_sample_ids(np.random.default_rng(7), 50_001, vocab, s, multiplier, offset)
    np.testing.assert_array_equal(got, want)


def test_the_compiled_remainder_is_exact_at_multiples() -> None:
    # Next to a multiple of m the float quotient lands on either side of it: the
    # correction matters there (about 4% of these), never on random x.
    from tilecore.data._zipf import _mod

    rng = np.random.default_rng(1)
    for m in (1, 3, 1000, 999_983, 2**24 + 7, 30_000_001, 2**31 - 1):
        for k in [*rng.integers(1, m + 1, 300).tolist(), m]:
            for x in (k * m - 1, k * m, k * m + 1):
                assert _mod(x, m, 1.0 / m) == x % m, (x, m)


@pytest.mark.parametrize("vocab", [1, 2, 3, 1000])
def test_zipf_tiny_vocabularies_stay_in_range(vocab: int) -> None:
    ids = sample_ids(np.random.default_rng(1), 10_000, vocab_size=vocab, exponent=1.2,
                     multiplier=1, offset=0)
    assert ids.min() >= 0 and ids.max() < vocab
    if vocab <= 3:
        assert len(np.unique(ids)) == vocab  # every rank is drawn
    start, width = inverse_cdf_table(vocab, 1.2)
    assert start[0] == 0 and start[-1] + width[-1] == pytest.approx(vocab)


def test_scatter_map_is_a_bijection() -> None:
    table = tc.TableSpec(name="t", vocab_size=10_007 * 6, embedding_dim=8)
    dist = data.IdDistribution.scattered(table, exponent=1.1, seed=3)
    ranks = np.arange(table.vocab_size, dtype=np.int64)
    ids = (ranks * dist.multiplier + dist.offset) % table.vocab_size
    assert len(np.unique(ids)) == table.vocab_size


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"Unknown workload 'nope'.*criteo"):
        data.get_workload("nope")
    with pytest.raises(ValueError, match="step must be >= 0"):
        data.criteo(batch_size=SMALL).batch(-1)
    with pytest.raises(ValueError, match="min_ids <= max_ids"):
        data.IdDistribution(exponent=1.1, min_ids=3, max_ids=2)
    table = tc.TableSpec(name="t", vocab_size=100, embedding_dim=8)
    feature = tc.FeatureSpec(name="f", table=table, input_shape=(SMALL, 1))
    with pytest.raises(ValueError, match=r"gcd\(multiplier, 100\) == 1"):
        data.Workload(name="w", features=(feature,), batch_size=SMALL,
                      distributions=(data.IdDistribution(exponent=1.1, multiplier=10),))


def test_options_columns_seeds_and_indices_of_the_wrong_kind(tmp_path: Path) -> None:
    """batch_size 2.5 read 3 rows, vocab 10.5 was kept, a bare column string was split into
    characters, a negative seed was numpy's unnamed error, and npz batch -1 was taken."""
    for kwargs, message in (({"batch_size": 2.5}, "batch_size must be an integer >= 1"),
                            ({"batch_size": True}, "batch_size must be an integer >= 1"),
                            ({"held_out_batches": 1.5}, "held_out_batches must be an integer"),
                            ({"vocab_sizes": (10.5,)},
                             r"vocab_sizes\[0\] must be an integer in \[1, \d+\], got 10.5")):
        with pytest.raises(ValueError, match=f"ReadOptions: {message}"):
            data.ReadOptions(**kwargs)  # type: ignore[arg-type]
    for kwargs, name in (({"sparse": "c00"}, "sparse"), ({"dense": "d0"}, "dense"),
                         ({"shared_tables": {"t": "c01"}}, r"shared_tables\['t'\]")):
        with pytest.raises(ValueError, match=f"ClickColumns: {name} must be a tuple of column "
                                             "names, got the string"):
            data.ClickColumns(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="get_workload: seed must be an integer >= 0, got -1"):
        data.get_workload("criteo", seed=-1)
    with pytest.raises(ValueError, match="write_sample: seed must be an integer >= 0, got -1"):
        data.write_sample(tmp_path, "criteo-tsv", rows=10, seed=-1)
    files = data.write_sample(tmp_path, "npz", rows=256, batch_size=64)
    source = data.open_click_data(files, data.ReadOptions(progress=False))
    for call in (lambda: source.train_batch(-1), lambda: source.eval_batch(-1)):
        with pytest.raises(ValueError, match="must be an integer >= 0, got -1"):
            call()
