"""nnx checkpoints of jax-tpu-embedding 0.2.0 and of tilecore.compat, read by the other side.

The reference's nnx `SparseCoreEmbed` and `save_checkpoint` run on the CPU once it
is told the SparseCores per device (it asks the TPU's device kind, which a CPU
lacks: `utils.num_sparsecores_per_device` is the one thing patched). Each side
writes its per-table arrays (unstacked with its own code: the reference's
`table_stacking.unstack_and_unshard_stacked_tables`) and dense values to `.npz`;
the other side restores the checkpoint — same topology, across topologies, or
after conversion — and must give back the same arrays bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _reference_peer import requires_reference, run_reference
from test_compat_checkpoint import assert_same_tables, dense, fresh, per_table, save
from tilecore.compat.lib.flax.nnx import checkpoint_utils as cu

pytestmark = requires_reference

REFERENCE_MODEL = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np, optax
from flax import nnx
import orbax.checkpoint as ocp
from jax_tpu_embedding.sparsecore.lib.flax.nnx import checkpoint_utils as cu, embed
from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec, table_stacking

def build(devices, sc, seed):
    embed.utils.num_sparsecores_per_device = lambda device=None: sc  # a CPU has no SparseCores
    opt = lambda: embedding_spec.AdagradOptimizerSpec(learning_rate=0.1)
    init = jax.nn.initializers.normal(1.0)
    tables = [embedding_spec.TableSpec(vocabulary_size=v, embedding_dim=d, initializer=init,
                                       optimizer=opt(), combiner="sum", name=n)
              for n, v, d in (("t1", 37, 5), ("t2", 20, 3), ("t3", 50, 12))]
    fs = {f"f{i}": embedding_spec.FeatureSpec(table_spec=t, input_shape=(16, 1),
                                              output_shape=(16, t.embedding_dim), name=f"f{i}")
          for i, t in enumerate(tables)}
    embedding.auto_stack_tables(fs, devices, sc)
    embedding.prepare_feature_specs_for_training(fs, global_device_count=devices,
                                                 num_sc_per_device=sc)

    class Model(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(seed)
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",))
            self.emb = embed.SparseCoreEmbed(fs, "x", mesh, rngs)
            self.dense = nnx.Linear(8, 2, rngs=rngs)

    model = Model()
    return fs, model, embed.PartitionedOptimizer(model, optax.adam(0.1))

def arrays(fs, model, opt, devices, sc):
    proto = embedding.create_proto_from_feature_specs(fs, devices, sc)
    value = model.emb.embedding_table.get_value()
    out = {}
    for what in ("table", "accumulator"):
        stacked = {k: jax.device_put(ev.table if what == "table" else ev.slot.accumulator,
                                     jax.devices()[0])  # tables need not split over devices
                   for k, ev in value.items()}
        tables = table_stacking.unstack_and_unshard_stacked_tables(stacked, proto, donate=False)
        out.update({f"{k}/{what}": np.asarray(v) for k, v in tables.items()})
    dense_leaves = jax.tree.leaves((nnx.state(model.dense), nnx.state(opt, nnx.OptState)))
    out.update({f"dense/{i}": np.asarray(x) for i, x in enumerate(dense_leaves)})
    return out
"""


def _load(path: Path) -> tuple[dict[str, dict[str, np.ndarray]], list[np.ndarray]]:
    """(per-table arrays, dense leaves) written by `arrays` on either side."""
    tables: dict[str, dict[str, np.ndarray]] = {}
    dense_leaves = {}
    with np.load(path) as data:
        for key in data.files:
            owner, what = key.split("/")
            if owner == "dense":
                dense_leaves[int(what)] = data[key]
            else:
                tables.setdefault(owner, {})[what] = data[key]
    return tables, [dense_leaves[i] for i in sorted(dense_leaves)]


@pytest.fixture(scope="module")
def reference_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Reference checkpoints of a 1×4 model (`one`) and a 2×2 model (`two`) with their
    arrays, and `two` converted by the reference for 1×4 (`two_as_1x4`)."""
    work = tmp_path_factory.mktemp("reference")
    run_reference(REFERENCE_MODEL + """
for name, devices, sc, seed in (("one", 1, 4, 0), ("two", 2, 2, 1)):
    fs, model, opt = build(devices, sc, seed)
    manager = cu.create_checkpoint_manager(cp_path=WORKDIR / name,
                                           cp_options=ocp.CheckpointManagerOptions())
    cu.save_checkpoint(cp_manager=manager, step=3, model=model, optimizer=opt,
                       feature_specs=fs, num_global_devices=devices, num_sc_per_device=sc)
    manager.wait_until_finished()
    np.savez(WORKDIR / f"{name}.npz", **arrays(fs, model, opt, devices, sc))
""", work)
    # The offline converter runs on a host without the training devices (here: one CPU, so
    # the 2-device arrays are read onto it; with both devices it fails to unshard t1's 37 rows).
    run_reference("""
from jax_tpu_embedding.sparsecore.lib.flax.nnx import checkpoint_utils as cu
cu.convert_cross_topology_checkpoint(input_checkpoint_path=WORKDIR / "two",
                                     output_checkpoint_path=WORKDIR / "two_as_1x4",
                                     target_topology=cu.TargetTopology(1, 4))
""", work)
    return work


def _check(fs: dict, model, opt, num_shards: int, expected: Path) -> None:
    want, want_dense = _load(expected)
    assert_same_tables(want, per_table(fs, model, num_shards))
    for got, exp in zip(dense(model, opt), want_dense, strict=True):
        np.testing.assert_array_equal(got, exp)


def test_reference_checkpoint_restores_on_the_same_topology(reference_checkpoints: Path) -> None:
    fs, model, opt = fresh(1, 4)
    cu.restore_checkpoint(input_checkpoint_path=reference_checkpoints / "one", model=model,
                          optimizer=opt)
    _check(fs, model, opt, 4, reference_checkpoints / "one.npz")


def test_reference_checkpoint_restores_across_topologies(reference_checkpoints: Path,
                                                         tmp_path: Path) -> None:
    """2 devices × 2 SCs (t2 rotated by 2) into 1 × 4 (rotated by 0) and, converted, 1 × 2."""
    source = reference_checkpoints / "two"
    fs, model, opt = fresh(1, 4)
    with pytest.raises(ValueError, match="restore_cross_topology_checkpoint"):
        cu.restore_checkpoint(input_checkpoint_path=source, model=model, optimizer=opt)
    cu.restore_cross_topology_checkpoint(
        cross_topology_checkpoint_restore_path=source, model=model, optimizer=opt,
        target_feature_specs=fs, num_global_devices=1, num_sc_per_device=4)
    _check(fs, model, opt, 4, reference_checkpoints / "two.npz")
    cu.convert_cross_topology_checkpoint(input_checkpoint_path=source,
                                         output_checkpoint_path=tmp_path / "converted",
                                         target_topology=cu.TargetTopology(1, 2))
    fs, model, opt = fresh(1, 2)
    cu.restore_checkpoint(input_checkpoint_path=tmp_path / "converted", model=model,
                          optimizer=opt)
    _check(fs, model, opt, 2, reference_checkpoints / "two.npz")


def test_reference_converted_checkpoint_restores(reference_checkpoints: Path) -> None:
    """The reference's offline conversion (2 × 2 → 1 × 4, NaN padding) restores in compat."""
    fs, model, opt = fresh(1, 4)
    cu.restore_checkpoint(input_checkpoint_path=reference_checkpoints / "two_as_1x4",
                          model=model, optimizer=opt)
    _check(fs, model, opt, 4, reference_checkpoints / "two.npz")


def test_compat_checkpoint_restores_in_the_reference(tmp_path: Path) -> None:
    fs, model, opt = fresh(1, 4)
    save(tmp_path / "compat", fs, model, opt, 1, 4, step=5)
    want_tables, want_dense = per_table(fs, model, 4), dense(model, opt)
    cu.convert_cross_topology_checkpoint(input_checkpoint_path=tmp_path / "compat",
                                         output_checkpoint_path=tmp_path / "converted",
                                         target_topology=cu.TargetTopology(2, 2))
    run_reference(REFERENCE_MODEL + """
for name, devices, sc in (("compat", 1, 4), ("converted", 2, 2)):
    fs, model, opt = build(devices, sc, seed=7)
    cu.restore_checkpoint(input_checkpoint_path=WORKDIR / name, model=model, optimizer=opt)
    np.savez(WORKDIR / f"{name}.npz", **arrays(fs, model, opt, devices, sc))
""", tmp_path)
    for name in ("compat", "converted"):
        got_tables, got_dense = _load(tmp_path / f"{name}.npz")
        assert_same_tables(want_tables, got_tables)
        for got, exp in zip(got_dense, want_dense, strict=True):
            np.testing.assert_array_equal(got, exp)
