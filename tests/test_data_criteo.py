"""Criteo-format TSV click logs: parsing against a plain-Python oracle, gzip, bad rows,
streaming, and random access by step (threads, pickled copies, epochs)."""

from __future__ import annotations

import gzip
import io
import math
import pickle
import random
import threading
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilecore import data
from tilecore.data import _criteo

VOCAB = (97,) * 26


def oracle(line: str, vocab: tuple[int, ...] = VOCAB) -> tuple[float, list[float], list[list[int]]]:
    """One line as the documented rules say: label, log(1 + max(x, 0)), int(hex, 16) mod V."""
    fields = line.split("\t")
    dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1:14]]
    ids = [[int(v, 16) % size] if v else [] for v, size in zip(fields[14:], vocab, strict=True)]
    return float(fields[0]), dense, ids


def check(batch: data.ClickBatch, lines: list[str], vocab: tuple[int, ...] = VOCAB) -> None:
    want = [oracle(line, vocab) for line in lines]
    np.testing.assert_array_equal(batch.labels, [w[0] for w in want])
    np.testing.assert_allclose(batch.dense, [w[1] for w in want], rtol=1e-6)
    for j in range(26):
        ragged = batch.sparse[f"C{j + 1}"]
        got = [ragged.values[a:b].tolist() for a, b in zip(ragged.row_splits[:-1],
                                                             ragged.row_splits[1:], strict=True)]
        assert got == [w[2][j] for w in want], j


def line(label: int = 1, ints: list[str] | None = None, cats: list[str] | None = None) -> str:
    ints = ["3"] * 13 if ints is None else ints
    cats = ["0a1b2c3d"] * 26 if cats is None else cats
    return "\t".join([str(label), *ints, *cats])


def write(path: Path, lines: list[str]) -> Path:
    text = "".join(f"{x}\n" for x in lines)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def options(**kw: object) -> data.ReadOptions:
    return data.ReadOptions(**{"batch_size": 4, "vocab_sizes": (97,), "held_out_batches": 1,
                               "progress": False, **kw})  # pyright: ignore[reportArgumentType]


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return data.write_sample(tmp_path_factory.mktemp("tsv"), "criteo-tsv", rows=400, seed=3)


def test_sample_parses_like_the_oracle_plain_and_gzip(sample: Path, tmp_path: Path) -> None:
    lines = sample.read_text().splitlines()
    assert any("\t\t" in x for x in lines) and any("\t-1\t" in x for x in lines)
    gz = write(tmp_path / "clicks.tsv.gz", lines)
    for path in (sample, gz):
        source = data.open_click_data(path, options(batch_size=50, held_out_batches=2))
        assert len(source.features) == 26 and source.num_dense == 13
        check(source.eval_batch(1), lines[50:100])
        check(source.train_batch(0), lines[100:150])  # training starts after the held out
        check(source.train_batch(5), lines[350:400])
        check(source.train_batch(6), lines[100:150])  # 6 training batches: epoch 2
        check(source.eval_batch(2), lines[:50])  # cycled over the 2 held-out batches


def test_empty_fields_negative_ints_and_crlf(tmp_path: Path) -> None:
    rows = [line(0, ["", "-7", *["12"] * 11], ["", "FFFFFFFFFFFFFFFF", *["1"] * 24]),
            line(1, [""] * 13, [""] * 26), line(), line(0)]
    path = tmp_path / "c.txt"
    path.write_bytes("".join(f"{x}\r\n" for x in rows * 2).encode())
    batch = data.open_click_data(path, options()).train_batch(0)
    check(batch, rows)
    assert batch.sparse["C1"].row_splits.tolist() == [0, 0, 0, 1, 2]
    assert batch.dense[1].tolist() == [0.0] * 13


@pytest.mark.parametrize("bad, column, message", [
    ("1\t2\t3", None, "3 tab-separated fields, expected 40"),
    (line(2), 1, "label must be 0 or 1, got '2'"),
    (line(ints=["3"] * 12 + ["4.5"]), 14, "I13 must be an integer"),
    (line(ints=["-"] + ["3"] * 12), 2, "I1 must be an integer"),
    (line(cats=["xyz"] + ["1"] * 25), 15, "C1 must be a hexadecimal value"),
    (line(cats=["1"] * 25 + ["0x1f"]), 40, "C26 must be a hexadecimal value .*, got '0x1f'"),
    (line(cats=["1" * 17] + ["1"] * 25), 15, "at most 16 digits"),
    ("", None, "1 tab-separated fields"),
], ids=["fields", "label", "float", "minus", "not_hex", "0x", "too_long", "blank"])
def test_bad_rows_name_file_line_and_column(tmp_path: Path, bad: str, column: int | None,
                                            message: str) -> None:
    path = write(tmp_path / "c.tsv", [line()] * 5 + [bad] + [line()] * 6)
    source = data.open_click_data(path, options())
    source.eval_batch(0)
    with pytest.raises(data.BadRowError, match=message) as info:
        source.train_batch(0)
    assert (info.value.path, info.value.line, info.value.column) == (path, 6, column)
    assert f"{path}, line 6" in str(info.value) and "--skip-bad-rows" in str(info.value)


def test_skipping_bad_rows_counts_them_once(tmp_path: Path) -> None:
    good = [line(i % 2, cats=[f"{i:x}"] * 26) for i in range(12)]
    path = write(tmp_path / "c.tsv", [*good[:3], "bad", *good[3:7], line(3), *good[7:]])
    source = data.open_click_data(path, options(skip_bad_rows=True))
    with pytest.warns(data.BadRowsWarning, match=r"c.tsv, line 4: 1 tab-separated"):
        check(source.eval_batch(0), good[:4])
    with pytest.warns(data.BadRowsWarning, match="skipped 2 bad rows"):
        for step in range(5):  # two epochs of two batches: read the file three times
            check(source.train_batch(step), good[4:8] if step % 2 == 0 else good[8:12])
    assert isinstance(source, data.StreamedClicks) and source.bad_rows == 2


def test_copies_merge_their_bad_rows_counting_each_once(tmp_path: Path) -> None:
    """Input worker processes read copies of the source: their counts come back to it."""
    good = [line(i % 2, cats=[f"{i:x}"] * 26) for i in range(16)]
    path = write(tmp_path / "c.tsv", [*good[:5], "bad", *good[5:9], line(3), *good[9:13],
                                      "also bad", *good[13:]])  # lines 6, 11 and 16
    source = data.open_click_data(path, options(skip_bad_rows=True))
    near, far = (pickle.loads(pickle.dumps(source)) for _ in range(2))
    with pytest.warns(data.BadRowsWarning):
        check(near.train_batch(0), good[4:8])  # past line 6
    with pytest.warns(data.BadRowsWarning):
        check(far.train_batch(2), good[12:16])  # past all three
    check(source.eval_batch(0), good[:4])
    assert (source.bad_rows, near.bad_rows, far.bad_rows) == (0, 1, 3)
    with pytest.warns(data.BadRowsWarning, match=r"c.tsv, line 6: 1 tab-separated"):
        source.merge_bad_rows(near.bad_rows_by_file())
    assert source.bad_rows == 1
    for copy in (far, near, far):  # rows seen by several copies count once
        source.merge_bad_rows(copy.bad_rows_by_file())
    assert source.bad_rows == 3
    check(source.train_batch(2), good[12:16])  # read here too: still counted once
    assert source.bad_rows == 3 and far.bad_rows_by_file() == source.bad_rows_by_file()


def test_random_access_from_threads_and_copies_matches_reading_in_order(sample: Path) -> None:
    lines = sample.read_text().splitlines()
    source = data.open_click_data(sample, options(batch_size=20, held_out_batches=1))
    epoch = 19  # 400 rows: 20 batches, one held out
    steps = list(range(3 * epoch))
    random.Random(0).shuffle(steps)
    got: dict[int, data.ClickBatch] = {}

    def work(part: list[int]) -> None:
        for step in part:
            got[step] = source.train_batch(step)

    threads = [threading.Thread(target=work, args=(steps[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    copy = pickle.loads(pickle.dumps(source))  # what an input worker process gets
    for step in range(0, 3 * epoch, 7):
        start = 20 * (1 + step % epoch)
        check(got[step], lines[start:start + 20])
        check(copy.train_batch(step), lines[start:start + 20])


def test_reads_a_file_larger_than_its_buffer_a_little_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "big.tsv", [line(cats=[f"{i:08x}"] * 26) for i in range(3000)])
    raws = []

    def spy(p: Path) -> tuple[IO[str], IO[bytes]]:
        text, raw = open_text(p)
        raws.append(raw)
        return text, raw

    open_text = _criteo.open_text
    monkeypatch.setattr(_criteo, "open_text", spy)
    source = data.open_click_data(path, options(batch_size=100))
    source.train_batch(1)
    size = path.stat().st_size
    assert size > 700_000 and all(raw.tell() < size // 8 for raw in raws)


def test_too_few_rows_and_unknown_paths(tmp_path: Path) -> None:
    path = write(tmp_path / "c.tsv", [line()] * 7)
    with pytest.raises(ValueError, match=r"only 1 full batches of 4 rows; the first 1 are held"):
        data.open_click_data(path, options()).train_batch(0)
    with pytest.raises(ValueError, match=r"unknown kind of data '\.csv'"):
        data.open_click_data(write(tmp_path / "c.csv", []), options())
    with pytest.raises(ValueError, match="no such file"):
        data.open_click_data(tmp_path / "absent.tsv")
    with pytest.raises(ValueError, match="3 vocabulary sizes for 26 sparse features"):
        data.open_click_data(path, options(vocab_sizes=(1, 2, 3)))


hex_field = st.one_of(st.just(""), st.integers(0, 2**64 - 1).map(lambda v: f"{v:x}"))
int_field = st.one_of(st.just(""), st.integers(-(10**18) + 1, 10**18 - 1).map(str))
rows = st.lists(st.tuples(st.integers(0, 1), st.lists(int_field, min_size=13, max_size=13),
                          st.lists(hex_field, min_size=26, max_size=26)), min_size=1, max_size=6)


@settings(max_examples=25)
@given(rows=rows, vocab=st.integers(1, 2**40))
def test_parser_matches_the_oracle(rows: list[tuple[int, list[str], list[str]]],
                                   vocab: int) -> None:
    lines = [line(label, ints, cats) for label, ints, cats in rows]
    check(_criteo.parse_lines(lines, (vocab,) * 26), lines, (vocab,) * 26)


def test_input_worker_processes_get_the_batches_of_their_steps(sample: Path) -> None:
    """`train --input-processes`: each worker reads its own copy, skipping the others'
    steps; together they return what the source returns in order."""
    import tilecore as tc
    from tilecore_apps.dlrm import ProcessBatches

    source = data.open_click_data(sample, options(batch_size=40, vocab_sizes=(50,)))
    specs = [tc.FeatureSpec(name=f.name, input_shape=(40, 1), table=tc.TableSpec(
        name=f.name, vocab_size=f.vocab_size, embedding_dim=4)) for f in source.features]
    plan = tc.plan_stacking(specs, tc.Topology(global_devices=1, sc_per_device=2))
    plan = plan.with_config(allow_id_dropping=True)
    with ProcessBatches(source, plan, start=3, stop=13, processes=2, depth=2,
                        num_threads=1) as batches:
        for step in range(3, 13):  # 9 training batches: steps 9-12 are the second epoch
            got, want = batches.take(step), source.train_batch(step)
            np.testing.assert_array_equal(got.labels, want.labels)
            np.testing.assert_array_equal(got.dense, want.dense)


def _damage(path: Path, how: str) -> None:
    packed = path.read_bytes()
    if how == "truncated":
        packed = packed[: len(packed) // 2]
    elif how == "bad CRC":  # the trailer's CRC-32: every line decodes, the check fails at the end
        packed = packed[:-8] + bytes(4) + packed[-4:]
    else:  # bytes flipped near the start: the deflate data cannot be decoded
        packed = packed[:20] + bytes(b ^ 0xFF for b in packed[20:40]) + packed[40:]
    path.write_bytes(packed)


@pytest.mark.parametrize("how", ["truncated", "bad CRC", "corrupt"])
def test_a_damaged_gzip_names_the_file_and_the_last_line_read(
        tmp_path: Path, how: str) -> None:
    """gzip's EOFError / BadGzipFile / zlib.error named neither file nor line; skipping bad
    rows cannot pass the damage either (nothing after it can be read)."""
    lines = [line(i % 2, cats=[f"{i * 7919:x}"] * 26) for i in range(3000)]
    path = write(tmp_path / "c.tsv.gz", lines)
    _damage(path, how)
    for skip in (False, True):
        source = data.open_click_data(path, options(batch_size=1000, skip_bad_rows=skip))
        with pytest.raises(data.DamagedFileError, match=rf"{path}: damaged after line \d+ "
                                                        rf"\(.*\); nothing past it can be read"):
            for step in range(3):
                source.train_batch(step)


def test_input_worker_processes_raise_the_errors_threads_raise(tmp_path: Path) -> None:
    """A bad row, or a damaged file, that a worker process meets is raised in the main
    process as the same error (an `InputWorkerError` holding its traceback before), so
    `tilecore train --input-processes` ends in one clear line too."""
    import tilecore as tc
    from tilecore_apps.dlrm import ProcessBatches

    good = [line(i % 2, cats=[f"{i:x}"] * 26) for i in range(40)]
    bad = write(tmp_path / "c.tsv", [*good[:30], line(3), *good[30:]])
    damaged = write(tmp_path / "d.tsv.gz", good * 50)
    _damage(damaged, "truncated")
    errors = (data.BadRowError, r"c.tsv, line 31, column 1: label must be 0 or 1, got '3'"), (
        data.DamagedFileError, r"d.tsv.gz: damaged after line")
    for path, (kind, message) in zip((bad, damaged), errors, strict=True):
        source = data.open_click_data(path, options(batch_size=10, vocab_sizes=(50,)))
        specs = [tc.FeatureSpec(name=f.name, input_shape=(10, 1), table=tc.TableSpec(
            name=f.name, vocab_size=f.vocab_size, embedding_dim=4)) for f in source.features]
        plan = tc.plan_stacking(specs, tc.Topology(global_devices=1, sc_per_device=2))
        with pytest.raises(kind, match=message), ProcessBatches(
                source, plan.with_config(allow_id_dropping=True), start=0, stop=200,
                processes=2, depth=2, num_threads=1) as batches:
            for step in range(200):
                batches.take(step)
    for error in (data.BadRowError(bad, 4, "C1", "why", unit="row"),
                  data.DamagedFileError(damaged, 7, "why")):
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), str(again), again.line) == (type(error), str(error), 7 if isinstance(
            error, data.DamagedFileError) else 4)


def test_long_reads_report_progress_quietly() -> None:
    from tilecore.data._progress import ReadProgress

    log = io.StringIO()  # not a terminal: a line now and then, never a redraw
    progress = ReadProgress("clicks.tsv", stream=log, after_s=0.0, every_s=3600.0)
    progress.start()
    for done in range(0, 100, 10):
        progress.update(done, 100, "batch 7")
    progress.finish()
    assert log.getvalue() == "reading clicks.tsv:   0.0% of the file, to batch 7\n"
    quiet = ReadProgress("clicks.tsv", stream=log)  # the default waits 2 s before a word
    quiet.start()
    quiet.update(50, 100, "batch 7")
    assert log.getvalue().count("\n") == 1


def test_categorical_columns_share_tables_as_configured(sample: Path) -> None:
    """`ClickColumns.shared_tables` works on TSV as on Parquet; the column roles, fixed in
    TSV, cannot be chosen (they were ignored before: a flag that did nothing)."""
    shared = data.ClickColumns(shared_tables={"ads": ("C3", "C1")})
    source = data.open_click_data(sample, options(columns=shared))
    tables = {f.name: f.table_name for f in source.features}
    assert tables["C1"] == tables["C3"] == "ads" and tables["C2"] == "C2"
    specs = data.click_feature_specs(source.features, 4, embedding_dim=4)
    assert len({s.table.name for s in specs}) == 25
    plain = data.open_click_data(sample, options())
    np.testing.assert_array_equal(source.train_batch(0).sparse["C1"].values,
                                  plain.train_batch(0).sparse["C1"].values)  # the same IDs

    def fails(message: str, **kw: object) -> None:
        with pytest.raises(ValueError, match=message):
            data.open_click_data(sample, options(**kw))

    fails(r"shared tables name columns \['C27'\], which are not sparse columns; the sparse "
          r"columns are \['C1', .*\(a Criteo TSV file's are C1 … C26\)",
          columns=data.ClickColumns(shared_tables={"t": ("C1", "C27")}))
    fails(r"share table 'ads' but have vocabulary sizes \{'C1': 11, 'C3': 13\}",
          columns=shared, vocab_sizes=tuple(range(11, 37)))
    fails(r"column roles cannot be chosen \(label='y'\)", columns=data.ClickColumns(label="y"))
    fails(r"column roles cannot be chosen \(sparse=\('C1',\)\)",
          columns=data.ClickColumns(sparse=("C1",)))
