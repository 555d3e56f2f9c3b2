"""`tilecore.compat.utils.utils`, `lib.core` and the small `embedding` names, on tilecore alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice
from jax.experimental import layout
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from tilecore import ops, specs, stacking
from tilecore.compat import embedding, embedding_spec
from tilecore.compat._native import resolve_num_sc_per_device
from tilecore.compat.lib.core import constants, input_preprocessing
from tilecore.compat.utils import utils
from tilecore.preprocessing import Agreement


@dataclasses.dataclass
class FakeDevice:
    device_kind: str


def test_num_sparsecores_per_device_tpu_kinds_and_tilecore_default() -> None:
    for kind, count in utils.NUM_SC_PER_DEVICE_MAP.items():
        assert utils.num_sparsecores_per_device(FakeDevice(kind)) == count
    default = resolve_num_sc_per_device(None)
    assert utils.num_sparsecores_per_device() == default  # the CPU test device
    assert utils.num_sparsecores_per_device(FakeDevice("NVIDIA H100 80GB HBM3")) == default
    with pytest.raises(ValueError, match=r"Unknown sparsecore count.*TPU v4"):
        utils.num_sparsecores_per_device(FakeDevice("TPU v4"))
    with pytest.raises(ValueError, match="Cannot determine device kind"):
        utils.num_sparsecores_per_device(object())  # type: ignore[arg-type]


def test_embedding_table_format_is_the_sharding_off_tpu_and_tiled_on_tpu() -> None:
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    spec = PartitionSpec("x", None)
    cpu = utils.embedding_table_format(mesh, spec)
    assert cpu == NamedSharding(mesh, spec)
    jax.device_put(np.zeros((8, 4), np.float32), cpu)  # JAX takes it off TPU
    tpu_mesh = AbstractMesh((2,), ("x",), abstract_device=AbstractDevice("TPU v6e", None, "tpu"))
    tpu = utils.embedding_table_format(tpu_mesh, spec)
    assert isinstance(tpu, layout.Format)
    assert tpu.layout == utils.Layout(major_to_minor=(0, 1), tiling=((8,),))
    assert tpu.sharding == NamedSharding(tpu_mesh, spec)


def _oracle_shard(table: np.ndarray, devices: int, sc: int) -> np.ndarray:
    """Row i → SparseCore i mod N, row i div N of its block (written with reshapes)."""
    n = devices * sc
    blocks = table.reshape(-1, n, *table.shape[1:]).swapaxes(0, 1)  # [N, vocab/N, ...]
    return blocks.reshape(devices, -1, *table.shape[1:])


@pytest.mark.parametrize(("shape", "devices", "sc", "dtype"), [
    ((64, 3), 2, 4, np.float32), ((24,), 2, 4, np.int32), ((16, 2, 3), 1, 2, np.float64),
    ((8, 5), 8, 1, jnp.bfloat16),
])
def test_shard_unshard_emb_table_match_the_oracle_and_round_trip(
        shape: tuple[int, ...], devices: int, sc: int, dtype: type) -> None:
    table = np.arange(np.prod(shape)).reshape(shape).astype(dtype)
    sharded = utils.shard_emb_table(table, num_devices=devices, num_sc_per_device=sc)
    np.testing.assert_array_equal(sharded, _oracle_shard(table, devices, sc))
    assert sharded.dtype == table.dtype and isinstance(sharded, np.ndarray)
    np.testing.assert_array_equal(utils.unshard_emb_table(sharded, sc), table)
    jitted = jax.jit(lambda t: utils.shard_emb_table(t, num_devices=devices,
                                                     num_sc_per_device=sc))(jnp.asarray(table))
    assert isinstance(jitted, jax.Array)
    np.testing.assert_array_equal(np.asarray(jitted), sharded)


def test_shard_emb_table_is_the_native_stack_layout() -> None:
    """For a vocabulary that needs no padding, the layout is `tilecore.ops.shard`'s."""
    topology = specs.Topology(global_devices=2, sc_per_device=4)
    table_spec = specs.TableSpec(name="t", vocab_size=128, embedding_dim=8)
    plan = stacking.plan_stacking([specs.FeatureSpec(name="f", table=table_spec,
                                                     input_shape=(8, 1))], topology)
    table = np.random.default_rng(0).normal(size=(128, 8)).astype(np.float32)
    (native,) = ops.shard(plan, {"t": table}).values()
    sharded = utils.shard_emb_table(table, num_devices=2, num_sc_per_device=4)
    np.testing.assert_array_equal(sharded.reshape(-1, 8), native)


def test_shard_unshard_emb_table_errors() -> None:
    table = np.zeros((20, 2), np.float32)
    with pytest.raises(ValueError, match=r"20 rows.*8 SparseCores"):
        utils.shard_emb_table(table, num_devices=2, num_sc_per_device=4)
    with pytest.raises(ValueError, match="Only MOD is supported"):
        utils.shard_emb_table(table, num_devices=1, num_sc_per_device=4, sharding_strategy="DIV")
    with pytest.raises(ValueError, match="power of two"):
        utils.shard_emb_table(np.zeros((24, 2)), num_devices=3, num_sc_per_device=1)
    with pytest.raises(ValueError, match="num_devices must be an integer >= 1"):
        utils.shard_emb_table(table, num_devices=0, num_sc_per_device=4)
    with pytest.raises(ValueError, match="rank >= 2"):
        utils.unshard_emb_table(np.zeros(8), 4)
    with pytest.raises(ValueError, match="12 rows"):
        utils.unshard_emb_table(np.zeros((2, 6)), 4)


def test_estimate_preprocessing_parameters_are_aligned_and_grow_with_load() -> None:
    small = utils.estimate_preprocessing_parameters(
        global_batch_size=1024, global_device_count=4, num_sc_per_device=4, valency=4.0)
    large = utils.estimate_preprocessing_parameters(
        global_batch_size=8192, global_device_count=4, num_sc_per_device=4, valency=4.0)
    for result in (small, large):
        assert result["max_ids_per_partition"] % 8 == 0
        assert result["max_unique_ids_per_partition"] % 8 == 0
        assert result["suggested_coo_buffer_size_per_device"] % 32 == 0
        assert result["suggested_coo_buffer_size_per_device"] >= 4 * result[
            "max_ids_per_partition"]
    assert all(large[k] > small[k] for k in small)
    with pytest.raises(ValueError, match=r"must all be positive.*valency"):
        utils.estimate_preprocessing_parameters(global_batch_size=8, global_device_count=1,
                                                num_sc_per_device=4, valency=0)
    with pytest.raises(ValueError, match="hot_shard_fraction"):
        utils.estimate_preprocessing_parameters(global_batch_size=8, global_device_count=1,
                                                num_sc_per_device=4, valency=1,
                                                hot_shard_fraction=1.5)


def _decode(buffers: tuple[jax.Array, ...], n: int, sc: int, rows_per_sc: int
            ) -> dict[tuple[int, int], float]:
    """(ID, sample) → summed weight, read back out of the row-pointer ranges."""
    pointers, ids, samples, gains = (np.asarray(b) for b in buffers)
    per_sc, slot = max(n, 8), ids.size // sc
    out: dict[tuple[int, int], float] = {}
    for s in range(sc):
        start = 0
        for p in range(n):
            end = int(pointers[s * per_sc + p])
            for j in range(s * slot + start, s * slot + end):
                out[(int(ids[j]) * n + p, s * rows_per_sc + int(samples[j]))] = float(gains[j])
            start = -(-end // 8) * 8
    return out


def test_core_preprocessing_conserves_ids_and_merges_duplicates() -> None:
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 40, rng.integers(0, 5)).tolist() for _ in range(8)]
    weights = [rng.uniform(0.5, 1.5, len(r)).round(2).tolist() for r in rows]
    out = input_preprocessing.preprocess_sparse_dense_matmul_input(
        rows, weights, mesh, max_ids_per_partition=16, max_unique_ids_per_partition=16,
        num_sc_per_device=2)
    assert out[1].shape == (16 * 2 * 2,) and out[0].shape == (2 * 8,)
    want: dict[tuple[int, int], float] = {}
    for sample, (ids, ws) in enumerate(zip(rows, weights, strict=True)):
        for i, w in zip(ids, ws, strict=True):
            want[(i, sample)] = want.get((i, sample), 0.0) + w
    got = _decode(out, n=2, sc=2, rows_per_sc=4)
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-6)
    assert constants.PADDING_VALUE == 2**31 - 1
    assert int(np.asarray(out[1])[-1]) == constants.PADDING_VALUE  # unused tail is filler
    dense = input_preprocessing.preprocess_sparse_dense_matmul_input(
        np.asarray([[1, 2], [3, 3]]), np.ones((2, 2), np.float32), mesh,
        max_ids_per_partition=8, max_unique_ids_per_partition=8, num_sc_per_device=1)
    assert _decode(dense, n=1, sc=1, rows_per_sc=2) == {(1, 0): 1.0, (2, 0): 1.0, (3, 1): 2.0}


def test_core_preprocessing_packs_caller_minibatches_after_one_another() -> None:
    """Each SparseCore's run holds every minibatch's partitions in order, from one
    global index: read back, each minibatch is the one-batch result of its rows."""
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    rng = np.random.default_rng(4)
    minibatches = [[rng.integers(0, 40, rng.integers(0, 4)).tolist() for _ in range(8)]
                   for _ in range(3)]
    weights = [[[1.0] * len(r) for r in rows] for rows in minibatches]
    kw: Any = {"max_ids_per_partition": 8, "max_unique_ids_per_partition": 8,
               "num_sc_per_device": 2}
    pointers, ids, samples, gains = (np.asarray(b) for b in
                                     input_preprocessing.preprocess_sparse_dense_matmul_input(
                                         minibatches, weights, mesh, **kw,
                                         enable_minibatching=True))
    n = 2  # one device of 2 SparseCores: 2 partitions
    assert ids.size == 3 * 8 * 2 * n and pointers.size == 2 * 3 * 8
    start = 0
    for sc in range(2):
        for m, (rows, ws) in enumerate(zip(minibatches, weights, strict=True)):
            got = {}
            for p in range(n):
                end = int(pointers[(sc * 3 + m) * 8 + p])
                got.update({(int(i) * n + p, sc * 4 + int(r)): float(g) for i, r, g in
                            zip(ids[start:end], samples[start:end], gains[start:end],
                                strict=True)})
                start = -(-end // 8) * 8
            want = _decode(input_preprocessing.preprocess_sparse_dense_matmul_input(
                rows, ws, mesh, **kw), n=n, sc=2, rows_per_sc=4)
            assert got == {k: v for k, v in want.items() if k[1] // 4 == sc}, (sc, m)


def test_core_preprocessing_errors() -> None:
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    call = input_preprocessing.preprocess_sparse_dense_matmul_input
    kw: Any = {"max_ids_per_partition": 2, "max_unique_ids_per_partition": 2, "num_sc_per_device": 1}
    with pytest.raises(ValueError, match="max_ids"):
        call([[1, 2, 3]], [[1.0, 1.0, 1.0]], mesh, **kw)
    with pytest.raises(ValueError, match="same length"):
        call([[1]], [[1.0], [2.0]], mesh, **kw)
    with pytest.raises(ValueError, match="1 IDs but 2 weights"):
        call([[1]], [[1.0, 2.0]], mesh, **kw)
    with pytest.raises(ValueError, match="3D"):
        call(np.zeros((1, 1, 1), np.int32), np.zeros((1, 1, 1)), mesh, **kw)
    with pytest.raises(ValueError, match="max_ids_per_partition must be positive"):
        call([[1]], [[1.0]], mesh, max_ids_per_partition=0, max_unique_ids_per_partition=1)
    with pytest.raises(ValueError, match=r"sequence .* of minibatches"):
        call(np.zeros((2, 1), np.int32), np.ones((2, 1)), mesh, **kw, enable_minibatching=True)
    with pytest.raises(ValueError, match="2 minibatches of features but 1"):
        call([[[1]], [[2]]], [[[1.0]]], mesh, **kw, enable_minibatching=True)
    with pytest.raises(ValueError, match="only MOD"):
        call([[1]], [[1.0]], mesh, **kw, sharding_strategy="DIV")


def test_embedding_small_names() -> None:
    init = embedding.EmbeddingVariablesInitializer(table=jnp.zeros, slot=(jnp.ones,))
    assert init._fields == ("table", "slot") and init.slot == (jnp.ones,)
    assert embedding.sharding_strategy_to_enum("mod") == embedding.sharding_strategy_to_enum(
        "MOD") == 1
    assert embedding.sharding_strategy_to_enum("MOD").name == "MOD"
    with pytest.raises(ValueError, match="Only MOD"):
        embedding.sharding_strategy_to_enum("DIV")
    for bad in ({"host_id": 2, "host_count": 2}, {"host_id": 0, "host_count": 0}):
        with pytest.raises(ValueError, match="get_all_reduce_interface"):
            embedding.get_all_reduce_interface(["a:1"], 9000, **bad)
    with pytest.raises(ValueError, match="peer_addresses"):
        embedding.get_all_reduce_interface("a:1", 9000)
    with pytest.raises(RuntimeError, match=r"jax.distributed.initialize"):
        embedding.get_all_reduce_interface(["a:1", "b:1"], 9000, host_id=0, host_count=2)


def test_all_reduce_interface_drives_minibatching_preprocessing() -> None:
    table = embedding_spec.TableSpec(
        name="t", vocabulary_size=64, embedding_dim=8, initializer=jax.nn.initializers.zeros,
        optimizer=embedding_spec.SGDOptimizerSpec(), combiner="sum",
        max_ids_per_partition=4, max_unique_ids_per_partition=4)
    feature = embedding_spec.FeatureSpec(name="f", table_spec=table, input_shape=[16, 4],
                                         output_shape=[16, 8])
    embedding.prepare_feature_specs_for_training([feature], global_device_count=1,
                                                 num_sc_per_device=1)
    interface = embedding.get_all_reduce_interface([], 9000)  # this one process
    assert isinstance(interface, Agreement) and interface.process_count == 1
    ids = np.arange(64, dtype=np.int32).reshape(16, 4)
    result, _ = embedding.preprocess_sparse_dense_matmul_input(
        [ids], None, [feature], 1, 1, num_sc_per_device=1, enable_minibatching=True,
        all_reduce_interface=interface)
    assert int(np.asarray(result.num_minibatches).reshape(-1)[0]) > 1
