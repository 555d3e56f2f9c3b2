"""Parquet click data: scalar and list columns of integer or string IDs, roles and
vocabularies, tables shared by columns, nulls, bad rows, several files, and the synthetic
sample read back exactly."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

import tilecore as tc
from tilecore import data
from tilecore.data._samples import STRING_FEATURE

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def options(**kw: object) -> data.ReadOptions:
    return data.ReadOptions(**{"batch_size": 3, "held_out_batches": 1, "progress": False,
                               **kw})  # pyright: ignore[reportArgumentType]


def rows_of(ragged: tc.Ragged) -> list[list[int]]:
    return [ragged.values[a:b].tolist() for a, b in itertools.pairwise(ragged.row_splits)]


def table(n: int = 9, **extra: object) -> object:
    columns = {"label": pa.array([i % 2 for i in range(n)], pa.int8()),
               "price": pa.array([float(i) for i in range(n)], pa.float32()),
               "user": pa.array([10 * i for i in range(n)], pa.int64()),
               "items": pa.array([list(range(i % 4)) for i in range(n)], pa.list_(pa.int32())),
               **extra}
    return pa.table(columns)


def test_the_sample_reads_back_as_the_dataset_wrote_it(tmp_path: Path) -> None:
    path = data.write_sample(tmp_path, "parquet", rows=1500, seed=4)
    want = data.clicks(seed=4, batch_size=1024)
    source = data.open_click_data(path, options(batch_size=512, held_out_batches=1))
    assert [(f.name, f.vocab_size) for f in source.features] == [
        (f.name, f.vocab_size) for f in want.features]  # vocabularies from the file's schema
    assert [f.max_ids > 1 for f in source.features] == [f.max_ids > 1 for f in want.features]
    first = want.train_batch(0)
    held, train = source.eval_batch(0), source.train_batch(0)  # rows 0-511, 512-1023
    np.testing.assert_array_equal(held.labels, first.labels[:512])
    np.testing.assert_array_equal(train.dense, first.dense[512:])
    for f in want.features:
        wrote = rows_of(first.sparse[f.name])[512:]
        if f.name == STRING_FEATURE:  # written as "ad-<id>": read as any string is
            wrote = [[string_row(f"ad-{v}", f.vocab_size) for v in row] for row in wrote]
        assert rows_of(train.sparse[f.name]) == wrote, f.name
    assert pq.read_schema(path).field(STRING_FEATURE).type == pa.string()
    wrapped = source.train_batch(1)  # 1500 rows: 2 full batches, 1 held out: 1 per epoch
    np.testing.assert_array_equal(wrapped.labels, train.labels)


def test_scalar_and_list_columns_nulls_and_hashing(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(table(user=pa.array([5, None, -3, 250, 7, 8], pa.int64()),
                         items=pa.array([[1, 2], None, [], [300], [1], [2]]), n=6), path)
    source = data.open_click_data(path, options(vocab_sizes=(100,), held_out_batches=1))
    assert [(f.name, f.vocab_size, f.max_ids) for f in source.features] == [
        ("user", 100, 1), ("items", 100, 2)]
    assert source.num_dense == 1
    batch = source.eval_batch(0)
    assert rows_of(batch.sparse["user"]) == [[5], [], [97]]  # null → no ID, -3 mod 100
    assert rows_of(batch.sparse["items"]) == [[1, 2], [], []]
    assert rows_of(source.train_batch(0).sparse["user"]) == [[50], [7], [8]]
    assert rows_of(source.train_batch(0).sparse["items"]) == [[0], [1], [2]]


def test_unsigned_ids_beyond_int64_are_taken_modulo_as_numbers(tmp_path: Path) -> None:
    """uint64 IDs at or above 2**63 once went through int64 and wrapped (as the TSV reader's
    16-digit hexadecimal values never did)."""
    path = tmp_path / "t.parquet"
    big = [2**63 + 5, 2**64 - 1, 7, 2**63]
    pq.write_table(table(user=pa.array([*big, 1, 2], pa.uint64()),
                         items=pa.array([[v] for v in big] + [[1], [2]], pa.list_(pa.uint64())),
                         n=6), path)
    batch = data.open_click_data(path, options(vocab_sizes=(1000,))).eval_batch(0)
    want = [[v % 1000] for v in big[:3]]
    assert rows_of(batch.sparse["user"]) == rows_of(batch.sparse["items"]) == want


def test_columns_as_configured(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(table(clicked=pa.array([1, 0, 1] * 3, pa.int64())), path)
    columns = data.ClickColumns(label="clicked", dense=("price", "user"), sparse=("items",))
    source = data.open_click_data(path, options(columns=columns, vocab_sizes=(7,)))
    assert [f.name for f in source.features] == ["items"] and source.num_dense == 2
    batch = source.train_batch(0)
    assert batch.labels.tolist() == [1, 0, 1] and batch.dense[:, 1].tolist() == [30, 40, 50]
    with pytest.raises(ValueError, match="more than one role"):
        data.ClickColumns(label="price", dense=("price",))


@pytest.mark.parametrize("column, value, reason", [
    ("label", None, "the label must be 0 or 1, got None"),
    ("label", 2, "the label must be 0 or 1, got 2"),
    ("price", math.nan, r"dense values must be finite numbers \(within float32.s range\), got nan"),
    ("items", [1, None], "a list of IDs may not hold nulls"),
])
def test_bad_rows_name_file_row_and_column(tmp_path: Path, column: str, value: object,
                                           reason: str) -> None:
    good = table()
    values = good.column(column).to_pylist()
    values[4] = value
    path = tmp_path / "t.parquet"
    pq.write_table(good.set_column(good.schema.get_field_index(column), column,
                                   pa.array(values, good.schema.field(column).type)), path)
    with pytest.raises(data.BadRowError, match=reason) as info:
        data.open_click_data(path, options()).train_batch(0)
    assert f"{path}, row 5, column {column!r}" in str(info.value)
    source = data.open_click_data(path, options(skip_bad_rows=True))
    with pytest.warns(data.BadRowsWarning, match="row 5"):
        batch = source.train_batch(0)
    assert batch.dense[:, 0].tolist() == [3, 5, 6]  # row 5 (price 4) skipped
    assert isinstance(source, data.StreamedClicks) and source.bad_rows == 1


def test_a_directory_of_files_is_one_stream(tmp_path: Path) -> None:
    whole = table(n=10)
    for k, (start, stop) in enumerate(((0, 4), (4, 5), (5, 10))):
        pq.write_table(whole.slice(start, stop - start), tmp_path / f"part-{k}.parquet")
    source = data.open_click_data(tmp_path, options(held_out_batches=1))
    assert [source.train_batch(s).dense[:, 0].tolist() for s in range(3)] == [
        [3, 4, 5], [6, 7, 8], [3, 4, 5]]
    pq.write_table(whole.cast(whole.schema.set(1, pa.field("price", pa.float64()))),
                   tmp_path / "part-9.parquet")
    with pytest.raises(ValueError, match=r"part-9.parquet: column 'price' is double"):
        data.open_click_data(tmp_path, options(held_out_batches=1)).train_batch(3)


def test_schema_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(table(name=pa.array(["a"] * 9)), path)
    with pytest.raises(ValueError, match="no columns \\['nope'\\]"):
        data.open_click_data(path, options(columns=data.ClickColumns(label="nope")))
    with pytest.raises(ValueError, match=r"sparse column 'price' holds float.*integers or "
                                         "strings"):
        data.open_click_data(path, options(columns=data.ClickColumns(sparse=("price",))))
    pq.write_table(pa.table({"label": [0, 1], "items": [[1], [2]]}), path)
    with pytest.raises(ValueError, match="found 0 dense and 1 sparse columns"):
        data.open_click_data(path, options())


def string_row(value: str, vocab: int) -> int:
    """The documented hash: 1-16 hex digits as the Criteo reader reads them, else BLAKE2b."""
    if re.fullmatch("[0-9a-fA-F]{1,16}", value):
        return int(value, 16) % vocab
    digest = hashlib.blake2b(value.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


def test_string_columns_are_hashed_into_the_table(tmp_path: Path) -> None:
    names = ["0a1b", "alice", None, "", "Zürich", "alice", "0A1B", "ffffffffffffffff", "x"]
    tags = [["a", "b"], None, [], ["alice"], ["0a1b", "a"], ["b"], ["c"], [], ["a"]]
    columns = {"name": pa.array(names),  # scalar string
               "city": pa.array(names, pa.large_string()),
               "genre": pa.array(names).dictionary_encode(),
               "tags": pa.array(tags, pa.list_(pa.string())),
               "topics": pa.array(tags, pa.large_list(pa.large_string())),
               "labels": pa.array(tags, pa.list_(pa.dictionary(pa.int32(), pa.string())))}
    path = tmp_path / "t.parquet"
    pq.write_table(table(**columns), path, row_group_size=4)  # batches span row groups
    vocab = 1 << 40
    source = data.open_click_data(path, options(vocab_sizes=(vocab,), held_out_batches=0))
    assert [(f.name, f.max_ids) for f in source.features] == [  # found without being named
        ("user", 1), ("items", 2), *((n, 1) for n in ("name", "city", "genre")),
        ("tags", 2), ("topics", 2), ("labels", 2)]
    got = {f.name: [] for f in source.features}
    for step in range(3):
        for name, ragged in source.train_batch(step).sparse.items():
            got[name] += rows_of(ragged)
    want = [[] if v is None else [string_row(v, vocab)] for v in names]
    assert got["name"] == got["city"] == got["genre"] == want
    assert got["tags"] == got["topics"] == got["labels"] == [
        [string_row(v, vocab) for v in t or []] for t in tags]
    assert want[0] == want[6] == [0x0A1B]  # as the TSV reader hashes C_j = 0a1b
    assert want[1] == [9933345172075899469 % vocab]  # the same in every process and run
    assert want[3] == [13020603013274838756 % vocab]  # "" is a value; only null is no ID
    bad = table(names=pa.array([["a"]] * 4 + [["a", None]] + [["b"]] * 4))
    pq.write_table(bad, path)
    with pytest.raises(data.BadRowError, match="row 5, column 'names': a list of IDs may not"):
        data.open_click_data(path, options()).train_batch(0)


def test_columns_share_a_table_as_configured(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(table(item=pa.array([str(i) for i in range(9)])), path)
    shared = data.ClickColumns(shared_tables={"things": ("user", "item", "items")})
    source = data.open_click_data(path, options(columns=shared, vocab_sizes=(50,)))
    assert [(f.name, f.table_name) for f in source.features] == [
        ("user", "things"), ("items", "things"), ("item", "things")]
    specs = data.click_feature_specs(source.features, 3, embedding_dim=4)
    assert len({id(s.table) for s in specs}) == 1 and specs[0].table.combiner == "mean"
    plan = tc.plan_stacking(specs, tc.Topology(global_devices=1, sc_per_device=2))
    assert list(plan.tables) == ["things"] and sorted(plan.features) == ["item", "items", "user"]
    assert [s.table.name for s in data.click_feature_specs(  # unshared: a table each
        data.open_click_data(path, options(vocab_sizes=(50,))).features, 3,
        embedding_dim=4)] == ["user", "items", "item"]
    schema = {"label": "label", "dense": ["price"], "sparse": [
        {"name": "user", "vocab_size": 50, "table": "t"},
        {"name": "items", "vocab_size": 50, "max_ids": 3, "table": "t"}]}
    saved = table().schema.with_metadata({b"tilecore.clicks": json.dumps(schema).encode()})
    pq.write_table(table().cast(saved), tmp_path / "saved.parquet")  # tables in the metadata
    assert [f.table_name for f in data.open_click_data(tmp_path / "saved.parquet",
                                                       options()).features] == ["t", "t"]

    def fails(message: str, **kw: object) -> None:
        with pytest.raises(ValueError, match=message):
            data.open_click_data(path, options(**kw))

    fails(r"share table 'things' but have vocabulary sizes \{'user': 10, 'items': 20, "
          r"'item': 30\}", columns=shared, vocab_sizes=(10, 20, 30))
    fails(r"shared tables name columns \['nope', 'price'\], which are not sparse",
          columns=data.ClickColumns(shared_tables={"t": ("user", "price", "nope")}))
    fails(r"shared tables \['item'\] have the names of sparse columns",
          columns=data.ClickColumns(shared_tables={"item": ("user", "items")}))
    with pytest.raises(ValueError, match=r"columns \['user'\] are in more than one shared"):
        data.ClickColumns(shared_tables={"a": ("user",), "b": ("items", "user")})
    with pytest.raises(ValueError, match=r"columns \['price'\], which are not sparse"):
        data.ClickColumns(dense=("price",), shared_tables={"a": ("price",)})
    with pytest.raises(ValueError, match="share table 'a'"):
        data.click_feature_specs([data.ClickFeature(name="x", vocab_size=5, table="a"),
                                  data.ClickFeature(name="a", vocab_size=6)], 8, embedding_dim=4)
