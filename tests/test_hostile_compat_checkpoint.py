"""Hostile cases for compat's nnx checkpoint utilities: a save whose specs do not
describe the model, a cross-topology restore given specs of another topology or
counts that are not integers, a model whose tables are not float32, and targets that
are not a TargetTopology. Models and checkpoints are `test_compat_checkpoint`'s."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import test_compat_checkpoint as base
from tilecore.compat.lib.flax.nnx import checkpoint_utils as cu


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1 × 4 checkpoint (step 2) of the base model."""
    path = tmp_path_factory.mktemp("hostile") / "src"
    fs, model, opt = base.fresh(1, 4)
    base.save(path, fs, model, opt, 1, 4, step=2)
    return path


def test_save_refuses_specs_that_do_not_describe_the_model(tmp_path: Path) -> None:
    """Specs of another vocabulary (same padding) were saved as the checkpoint's spec
    without a word; a later cross-topology restore misread the arrays by it."""
    _, model, opt = base.fresh(1, 4)
    manager = cu.create_checkpoint_manager(cp_path=tmp_path,
                                           cp_options=ocp.CheckpointManagerOptions())
    with pytest.raises(ValueError, match=r"feature_specs do not describe the tables of the "
                                         r"model's SparseCoreEmbed 'emb':\n  - table 't1': "
                                         r".* \(45, 5\) saved, \(37, 5\) in the model"):
        cu.save_checkpoint(cp_manager=manager, step=1, model=model, optimizer=opt,
                           feature_specs=base.feature_specs(1, 4, vocab=45),
                           num_global_devices=1, num_sc_per_device=4)
    assert manager.all_steps() == []
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module"):
        cu.save_checkpoint(cp_manager=manager, step=1, model=None,  # pyright: ignore[reportArgumentType]
                           optimizer=opt, feature_specs=base.feature_specs(1, 4),
                           num_global_devices=1, num_sc_per_device=4)


def test_cross_topology_restore_keeps_the_models_table_dtype(saved: Path) -> None:
    """The restored tables were float32 in a bfloat16 model (a same-topology restore
    casts to the model's dtype)."""
    fs, model, opt = base.build(1, 4, seed=7)
    variables = model.emb.embedding_table.get_value()
    model.emb.embedding_table.set_value({k: type(v)(table=v.table.astype(jnp.bfloat16),
                                                    slot=v.slot) for k, v in variables.items()})
    cu.restore_cross_topology_checkpoint(
        cross_topology_checkpoint_restore_path=saved, model=model, optimizer=opt,
        target_feature_specs=fs, num_global_devices=1, num_sc_per_device=4)
    restored = model.emb.embedding_table.get_value()
    assert {v.table.dtype for v in restored.values()} == {jnp.dtype(jnp.bfloat16)}
    assert {v.slot.accumulator.dtype for v in restored.values()} == {jnp.dtype(jnp.float32)}


def test_cross_topology_restore_checks_the_target_specs_and_counts(saved: Path) -> None:
    """Specs stacked for 1 × 2 under a 1 × 4 model gave numpy's "could not broadcast input
    array from shape (4,8,8) into shape (4,0,8)"; a float count a raw TypeError."""
    fs, model, opt = base.fresh(1, 4)
    kwargs = {"cross_topology_checkpoint_restore_path": saved, "model": model,
              "optimizer": opt}
    with pytest.raises(ValueError, match=r"target_feature_specs are not stacked for 1 devices × "
                                         r"4 SparseCores .*table 't1'"):
        cu.restore_cross_topology_checkpoint(**kwargs, target_feature_specs=base.feature_specs(
            1, 2), num_global_devices=1, num_sc_per_device=4)
    with pytest.raises(TypeError, match=r"integer device and SparseCore counts; got "
                                        r"num_global_devices=1.0"):
        cu.restore_cross_topology_checkpoint(**kwargs, target_feature_specs=fs,
                                             num_global_devices=1.0, num_sc_per_device=4)


def test_convert_target_topology_of_numpy_ints_or_not_a_topology(saved: Path,
                                                                 tmp_path: Path) -> None:
    """NumPy counts were refused as not positive integers; a plain tuple raised
    AttributeError: 'tuple' object has no attribute 'num_global_devices'."""
    with pytest.raises(TypeError, match=r"target_topology must be a TargetTopology.*got tuple"):
        cu.convert_cross_topology_checkpoint(input_checkpoint_path=saved,
                                             output_checkpoint_path=tmp_path / "a",
                                             target_topology=(2, 4))  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"integer device and SparseCore counts; got "
                                        r"num_global_devices=True"):
        cu.convert_cross_topology_checkpoint(input_checkpoint_path=saved,
                                             output_checkpoint_path=tmp_path / "b",
                                             target_topology=cu.TargetTopology(True, 4))
    cu.convert_cross_topology_checkpoint(
        input_checkpoint_path=saved, output_checkpoint_path=tmp_path / "c",
        target_topology=cu.TargetTopology(np.int64(2), np.int64(4)))  # pyright: ignore[reportArgumentType]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["2"]


def test_convert_for_more_partitions_than_memory_holds_is_refused(
        saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target of 2**21 devices pads every table to 2**24 rows, GiBs of arrays: numpy's
    allocation failed midway (a bare MemoryError), or with overcommit the OOM killer ended
    the process. Refused before anything is allocated (this host's memory taken as 1 GiB,
    so that the case is the same on every machine)."""
    from tilecore.compat import _checkpoint_layout

    monkeypatch.setattr(_checkpoint_layout, "host_memory_bytes", lambda: 2**30)
    with pytest.raises(MemoryError, match=r"for 8388608 partitions needs [\d,.]+ GiB of tables "
                                          r"and slots, more than this host's memory and swap "
                                          r"\(1\.0 GiB\); the largest stacks: 't1_t2'"):
        cu.convert_cross_topology_checkpoint(input_checkpoint_path=saved,
                                             output_checkpoint_path=tmp_path / "huge",
                                             target_topology=cu.TargetTopology(2**21, 4))


def test_an_unstacked_conversion_is_not_called_damaged(saved: Path, tmp_path: Path) -> None:
    """Reading the output of a conversion without target_topology said "The checkpoint is
    damaged; write it again" (it holds per-table arrays, by design)."""
    cu.convert_cross_topology_checkpoint(input_checkpoint_path=saved,
                                         output_checkpoint_path=tmp_path / "flat")
    with pytest.raises(ValueError, match=r"holds one unstacked \[vocab, dim\] array per table "
                                         r"\(\['t1', 't2', 't3'\]\).*with a target_topology"):
        cu.convert_cross_topology_checkpoint(input_checkpoint_path=tmp_path / "flat",
                                             output_checkpoint_path=tmp_path / "again",
                                             target_topology=cu.TargetTopology(2, 4))


@pytest.mark.parametrize("kind", ["v6e", "GPU"])
def test_converter_refuses_an_unknown_target_device_kind(saved: Path, tmp_path: Path,
                                                         kind: str) -> None:
    """A kind not starting with "TPU" got tilecore's default of 4 SparseCores silently (the
    reference raises ValueError: Unknown sparsecore count for device kind)."""
    from tilecore.compat.lib.flax.nnx import offline_converter

    with pytest.raises(ValueError, match=rf"Unknown sparsecore count for device kind: '{kind}'"):
        offline_converter.main(["prog", f"--input_checkpoint={saved}",
                                f"--output_checkpoint={tmp_path / 'out'}",
                                "--target_num_devices=2", f"--target_device_kind={kind}"])
    assert not (tmp_path / "out").exists()
