"""compat's nnx checkpoint utilities and offline converter (tilecore only).

A model is a compat `SparseCoreEmbed` (two tables stacked into one stack, plus one
table alone) and an `nnx.Linear`, trained by a `PartitionedOptimizer`. Tables are
compared per table (unstacked, unsharded with the model's own specs), so a
checkpoint re-laid for another topology must give back the real rows bit for bit.
Multi-device runs happen in one subprocess with 4 fake CPU devices (this file run
as a script, which asserts and prints "multidevice ok").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import flax.nnx as nnx
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from _xla_flags import xla_flags
from tilecore.checkpoint import CheckpointCorruptError
from tilecore.compat.lib.flax.nnx import checkpoint_utils as cu
from tilecore.compat.lib.flax.nnx import embed, offline_converter
from tilecore.compat.lib.nn import embedding, embedding_spec, table_stacking

HERE = Path(__file__)
OPTIMIZERS = {"adagrad": lambda: embedding_spec.AdagradOptimizerSpec(learning_rate=0.1),
              "sgd": lambda: embedding_spec.SGDOptimizerSpec(learning_rate=0.1)}


def feature_specs(devices: int, sc: int, optimizer: str = "adagrad", vocab: int = 37) -> dict:
    """t1 and t2 (same width, stacked together by auto-stacking) and t3 (wider, alone)."""
    opt = OPTIMIZERS[optimizer]
    init = jax.nn.initializers.normal(1.0)
    tables = [embedding_spec.TableSpec(vocabulary_size=v, embedding_dim=d, initializer=init,
                                       optimizer=opt(), combiner="sum", name=n)
              for n, v, d in (("t1", vocab, 5), ("t2", 20, 3), ("t3", 50, 12))]
    fs = {f"f{i}": embedding_spec.FeatureSpec(table_spec=t, input_shape=(16, 1),
                                              output_shape=(16, t.embedding_dim), name=f"f{i}")
          for i, t in enumerate(tables)}
    embedding.auto_stack_tables(fs, devices, sc)
    embedding.prepare_feature_specs_for_training(fs, global_device_count=devices,
                                                 num_sc_per_device=sc)
    return fs


class Model(nnx.Module):
    def __init__(self, fs: dict, devices: int, sc: int, seed: int) -> None:
        rngs = nnx.Rngs(seed)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",))
        self.emb = embed.SparseCoreEmbed(fs, "x", mesh, rngs, num_sc_per_device=sc)
        self.dense = nnx.Linear(8, 2, rngs=rngs)


def build(devices: int, sc: int, seed: int, optimizer: str = "adagrad", vocab: int = 37
          ) -> tuple[dict, Model, nnx.Optimizer]:
    """Specs, model and optimizer; the seed decides every initial value."""
    fs = feature_specs(devices, sc, optimizer, vocab)
    model = Model(fs, devices, sc, seed)
    opt = embed.PartitionedOptimizer(model, optax.adam(0.1))
    opt.step.set_value(opt.step.get_value() + seed)  # a distinct optimizer state per seed
    return fs, model, opt


_BUILT: dict[tuple, tuple[dict, Model, nnx.Optimizer]] = {}


def fresh(devices: int, sc: int, optimizer: str = "adagrad", vocab: int = 37
          ) -> tuple[dict, Model, nnx.Optimizer]:
    """A model of this configuration with values no earlier call had.

    Building compiles the table initializers, so each configuration is built once per
    process; later calls shift every array of the model and optimizer by one instead.
    """
    key = (devices, sc, optimizer, vocab)
    if key not in _BUILT:
        _BUILT[key] = build(devices, sc, seed=len(_BUILT), optimizer=optimizer, vocab=vocab)
        return _BUILT[key]
    fs, model, opt = _BUILT[key]
    nnx.update(model, jax.tree.map(lambda x: x + 1, nnx.state(model)))
    nnx.update(opt, jax.tree.map(lambda x: x + 1, nnx.state(opt, nnx.OptState)))
    return fs, model, opt


def per_table(fs: dict, model: Model, num_shards: int) -> dict[str, dict[str, np.ndarray]]:
    """Table name → its `[vocab, dim]` table and slots, unstacked with the model's specs."""
    out: dict[str, dict[str, np.ndarray]] = {}
    specs = embedding.get_table_specs(fs)
    for stack, ev in model.emb.embedding_table.get_value().items():
        members = {n: s for n, s in specs.items() if s.stacked_table_spec.stack_name == stack}
        arrays = {"table": np.asarray(ev.table),
                  **{k: np.asarray(v) for k, v in ev.slot._asdict().items()}}
        for what, array in arrays.items():
            tables = table_stacking.unshard_and_unstack_tables(members, {stack: array}, num_shards)
            for name in members:
                out.setdefault(name, {})[what] = tables[name]
    return out


def assert_same_tables(want: dict, got: dict) -> None:
    assert sorted(want) == sorted(got)
    for name in want:
        assert sorted(want[name]) == sorted(got[name]), name
        for what in want[name]:
            np.testing.assert_array_equal(got[name][what], want[name][what], err_msg=name + what)


def dense(model: Model, opt: nnx.Optimizer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((nnx.state(model.dense),
                                                    nnx.state(opt, nnx.OptState)))]


def save(path: Path, fs: dict, model: Model, opt: nnx.Optimizer, devices: int, sc: int,
         step: int = 1) -> None:
    manager = cu.create_checkpoint_manager(cp_path=path, cp_options=ocp.CheckpointManagerOptions())
    cu.save_checkpoint(cp_manager=manager, step=step, model=model, optimizer=opt,
                       feature_specs=fs, num_global_devices=devices, num_sc_per_device=sc)
    manager.wait_until_finished()
    manager.close()


def _multidevice(root: Path) -> None:
    """Save on 2 devices × 2 SCs; restore there, on 1 × 2, and converted for 4 × 2 and 1 × 2."""
    fs, model, opt = build(2, 2, seed=0)
    want, want_dense = per_table(fs, model, 4), dense(model, opt)
    save(root / "a", fs, model, opt, 2, 2)
    fs2, model2, opt2 = build(2, 2, seed=1)
    cu.restore_checkpoint(input_checkpoint_path=root / "a", model=model2, optimizer=opt2)
    assert_same_tables(want, per_table(fs2, model2, 4))
    for got, exp in zip(dense(model2, opt2), want_dense, strict=True):
        np.testing.assert_array_equal(got, exp)
    stack = next(iter(model2.emb.embedding_table.get_value().values()))
    assert stack.table.sharding.is_equivalent_to(jax.sharding.NamedSharding(
        model2.emb.mesh, jax.sharding.PartitionSpec("x", None)), 2)
    fs3, model3, opt3 = fresh(1, 2)
    cu.restore_cross_topology_checkpoint(
        cross_topology_checkpoint_restore_path=root / "a", model=model3, optimizer=opt3,
        target_feature_specs=fs3, num_global_devices=1, num_sc_per_device=2)
    assert_same_tables(want, per_table(fs3, model3, 2))
    for got, exp in zip(dense(model3, opt3), want_dense, strict=True):
        np.testing.assert_array_equal(got, exp)
    cu.convert_cross_topology_checkpoint(
        input_checkpoint_path=root / "a", output_checkpoint_path=root / "b",
        target_topology=cu.TargetTopology(4, 2), save_step=7)
    offline_converter.main(["prog", f"--input_checkpoint={root / 'a'}", "--output_checkpoint",
                            str(root / "c"), "--target_num_devices=1",
                            "--target_device_kind=TPU_v6e"])
    for path, devices, sc in ((root / "b", 4, 2), (root / "c", 1, 2)):
        fs4, model4, opt4 = fresh(devices, sc)
        cu.restore_checkpoint(input_checkpoint_path=path, model=model4, optimizer=opt4)
        assert_same_tables(want, per_table(fs4, model4, devices * sc))
        for got, exp in zip(dense(model4, opt4), want_dense, strict=True):
            np.testing.assert_array_equal(got, exp)
    print("multidevice ok")


def test_save_restore_convert_across_device_counts(tmp_path: Path) -> None:
    env = {**os.environ, "XLA_FLAGS": xla_flags(4),
           "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(HERE), "multidevice", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "multidevice ok" in result.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[np.ndarray]]:
    """A checkpoint of a 1-device × 4-SC model with steps 1 and 2 (step 2 the model's)."""
    path = tmp_path_factory.mktemp("ckpt") / "run"
    fs1, model1, opt1 = fresh(1, 4)
    save(path, fs1, model1, opt1, 1, 4, step=1)
    fs, model, opt = fresh(1, 4)
    save(path, fs, model, opt, 1, 4, step=2)
    return path, per_table(fs, model, 4), dense(model, opt)


def test_restore_latest_and_named_step(saved: tuple[Path, dict, list]) -> None:
    path, want, want_dense = saved
    fs, model, opt = fresh(1, 4)
    cu.restore_checkpoint(input_checkpoint_path=path, model=model, optimizer=opt)
    assert_same_tables(want, per_table(fs, model, 4))
    np.testing.assert_array_equal(dense(model, opt)[1], want_dense[1])
    cu.restore_checkpoint(input_checkpoint_path=path, model=model, optimizer=opt, step=1)
    assert not np.array_equal(per_table(fs, model, 4)["t1"]["table"], want["t1"]["table"])
    with pytest.raises(ValueError, match=r"Step 9 not found .*\[1, 2\]"):
        cu.restore_checkpoint(input_checkpoint_path=path, model=model, optimizer=opt, step=9)
    cu.restore_checkpoint(model=model, optimizer=opt)  # nothing to restore from: no-op


def test_sgd_tables_without_slots_convert_and_restore(tmp_path: Path) -> None:
    fs, model, opt = fresh(1, 4, optimizer="sgd")
    save(tmp_path / "a", fs, model, opt, 1, 4)
    cu.convert_cross_topology_checkpoint(input_checkpoint_path=tmp_path / "a",
                                         output_checkpoint_path=tmp_path / "b",
                                         target_topology=cu.TargetTopology(1, 2))
    fs2, model2, opt2 = fresh(1, 2, optimizer="sgd")
    cu.restore_checkpoint(input_checkpoint_path=tmp_path / "b", model=model2, optimizer=opt2)
    assert_same_tables(per_table(fs, model, 4), per_table(fs2, model2, 2))


def test_convert_without_target_unstacks_every_table(saved: tuple[Path, dict, list],
                                                     tmp_path: Path) -> None:
    path, want, _ = saved
    offline_converter.main([f"--input_checkpoint={path}", f"--output_checkpoint={tmp_path}/u"])
    manager = cu.create_checkpoint_manager(
        cp_path=tmp_path / "u", cp_options=ocp.CheckpointManagerOptions(read_only=True))
    tree = manager.item_metadata(2)["model"].tree
    restored = manager.restore(2, args=ocp.args.Composite(model=ocp.args.StandardRestore(
        jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree))))
    tables = restored["model"]["emb"]["embedding_table"]["value"]
    assert sorted(tables) == ["t1", "t2", "t3"]
    for name, arrays in want.items():
        got = tables[name]
        np.testing.assert_array_equal(got["table"], arrays["table"])
        np.testing.assert_array_equal(got["slot"]["accumulator"], arrays["accumulator"])


def test_convert_with_target_feature_specs(saved: tuple[Path, dict, list],
                                           tmp_path: Path) -> None:
    path, want, _ = saved
    target = feature_specs(1, 2)
    with pytest.raises(ValueError, match="not stacked for 1 devices × 4 SparseCores"):
        cu.convert_cross_topology_checkpoint(
            input_checkpoint_path=path, output_checkpoint_path=tmp_path / "bad",
            target_topology=cu.TargetTopology(1, 4), target_feature_specs=target)
    kwargs = {"input_checkpoint_path": path, "output_checkpoint_path": tmp_path / "new",
              "target_topology": cu.TargetTopology(1, 2), "target_feature_specs": target}
    cu.convert_cross_topology_checkpoint(**kwargs)
    with pytest.raises(ValueError, match="already holds step 2"):
        cu.convert_cross_topology_checkpoint(**kwargs)
    fs, model, opt = fresh(1, 2)
    cu.restore_checkpoint(input_checkpoint_path=tmp_path / "new", model=model, optimizer=opt)
    assert_same_tables(want, per_table(fs, model, 2))


def _strip_spec(path: Path, step: int, activation_limit: int | None = None) -> None:
    """Drop combiners and optimizers from a step's spec (as older protos lack them)."""
    from google.protobuf import text_format

    from tilecore.compat.lib.proto import embedding_spec_pb2

    file = path / str(step) / "embedding_spec" / "proto.pbtxt"
    proto = text_format.Parse(file.read_text(), embedding_spec_pb2.EmbeddingSpecProto())
    for stack in proto.stacked_table_specs:
        if activation_limit is not None:
            stack.activation_mem_bytes_limit = activation_limit
        for table in stack.table_specs:
            table.ClearField("combiner")
            table.ClearField("optimizer")
    file.write_text(text_format.MessageToString(proto))


def test_convert_spec_without_optimizers_keeps_the_stacks(saved: tuple[Path, dict, list],
                                                          tmp_path: Path) -> None:
    path, want, _ = saved
    shutil.copytree(path, tmp_path / "old")
    _strip_spec(tmp_path / "old", 2)
    cu.convert_cross_topology_checkpoint(input_checkpoint_path=tmp_path / "old",
                                         output_checkpoint_path=tmp_path / "new",
                                         target_topology=cu.TargetTopology(1, 2))
    fs, model, opt = fresh(1, 2)
    cu.restore_checkpoint(input_checkpoint_path=tmp_path / "new", model=model, optimizer=opt)
    assert_same_tables(want, per_table(fs, model, 2))
    _strip_spec(tmp_path / "old", 2, activation_limit=64)
    with pytest.raises(ValueError, match=r"Stack 't1_t2'.*Pass target_feature_specs"):
        cu.convert_cross_topology_checkpoint(input_checkpoint_path=tmp_path / "old",
                                             output_checkpoint_path=tmp_path / "new2",
                                             target_topology=cu.TargetTopology(1, 2))


def test_missing_item_names_the_item_and_directory(saved: tuple[Path, dict, list],
                                                   tmp_path: Path) -> None:
    path = tmp_path / "copy"
    shutil.copytree(saved[0], path)
    shutil.rmtree(path / "2" / "optimizer")
    _, model, opt = fresh(1, 4)
    with pytest.raises(ValueError, match=r'No "optimizer" found .*copy/2'):
        cu.restore_checkpoint(input_checkpoint_path=path, model=model, optimizer=opt, step=2)
    with pytest.raises(ValueError, match=r"No checkpoints found in .*nowhere"):
        cu.convert_cross_topology_checkpoint(input_checkpoint_path=tmp_path / "nowhere",
                                             output_checkpoint_path=tmp_path / "out")


# Reads of the other arrays finish after the failed restore closed Orbax's event loop; their
# callbacks' "Event loop is closed" is Orbax/tensorstore noise, not an error of the restore.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_truncated_array_file_raises_corrupt(saved: tuple[Path, dict, list],
                                             tmp_path: Path) -> None:
    path = tmp_path / "copy"
    shutil.copytree(saved[0], path)
    for data in (path / "2" / "model").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:10])
    _, model, opt = fresh(1, 4)
    with pytest.raises(CheckpointCorruptError, match=r"copy/2"):
        cu.restore_checkpoint(input_checkpoint_path=path, model=model, optimizer=opt, step=2)
    (path / "2" / "model" / "_METADATA").write_text("{garbage")
    with pytest.raises(CheckpointCorruptError, match=r"metadata of checkpoint .*copy/2"):
        cu.convert_cross_topology_checkpoint(input_checkpoint_path=path,
                                             output_checkpoint_path=tmp_path / "out")


def test_damaged_spec_names_the_table(saved: tuple[Path, dict, list], tmp_path: Path) -> None:
    path = tmp_path / "copy"
    shutil.copytree(saved[0], path)
    spec = path / "2" / "embedding_spec" / "proto.pbtxt"
    text = spec.read_text()
    spec.write_text(text.replace("padded_vocab_size: 64", "padded_vocab_size: 72", 1))
    fs, model, opt = fresh(1, 2)
    with pytest.raises(ValueError, match=r"inconsistent.*table 't1'"):
        cu.restore_cross_topology_checkpoint(
            cross_topology_checkpoint_restore_path=path, model=model, optimizer=opt,
            target_feature_specs=fs, num_global_devices=1, num_sc_per_device=2)
    spec.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointCorruptError, match="embedding_spec"):
        cu.restore_checkpoint(input_checkpoint_path=path, model=model, optimizer=opt, step=2)
    # A consistent spec of another topology (2 SparseCores) next to 4-SparseCore arrays.
    from google.protobuf import text_format

    from tilecore.compat.lib.nn.embedding_proto_utils import create_proto_from_feature_specs

    spec.write_text(text_format.MessageToString(create_proto_from_feature_specs(fs, 1, 2)))
    with pytest.raises(ValueError, match=r"Stack 't1_t2' in .*copy/2: .* has shape \(96, 8\)"
                                         r".* records \(80, 8\)"):
        cu.convert_cross_topology_checkpoint(input_checkpoint_path=path,
                                             output_checkpoint_path=tmp_path / "out")


def test_other_topology_or_sizes_are_refused(saved: tuple[Path, dict, list]) -> None:
    path = saved[0]
    fs, model, opt = fresh(1, 2)
    with pytest.raises(ValueError, match="restore_cross_topology_checkpoint"):
        cu.restore_checkpoint(input_checkpoint_path=path, model=model, optimizer=opt)
    with pytest.raises(ValueError, match=r"not \(1, 4\)"):
        cu.restore_cross_topology_checkpoint(
            cross_topology_checkpoint_restore_path=path, model=model, optimizer=opt,
            target_feature_specs=fs, num_global_devices=1, num_sc_per_device=4)
    fs, model, opt = fresh(1, 2, vocab=45)
    before = per_table(fs, model, 2), dense(model, opt)
    with pytest.raises(ValueError, match=r"Table 't1'.*\(45, 5\).*\(37, 5\)"):
        cu.restore_cross_topology_checkpoint(
            cross_topology_checkpoint_restore_path=path, model=model, optimizer=opt,
            target_feature_specs=fs, num_global_devices=1, num_sc_per_device=2)
    assert_same_tables(before[0], per_table(fs, model, 2))  # a failed restore changes nothing
    for got, exp in zip(dense(model, opt), before[1], strict=True):
        np.testing.assert_array_equal(got, exp)
    fs, model, opt = fresh(1, 4, optimizer="sgd")
    with pytest.raises(ValueError, match="accumulator"):
        cu.restore_checkpoint(input_checkpoint_path=path, model=model, optimizer=opt)


def test_save_refuses_a_topology_the_specs_were_not_stacked_for(tmp_path: Path) -> None:
    fs, model, opt = fresh(1, 4)
    manager = cu.create_checkpoint_manager(cp_path=tmp_path,
                                           cp_options=ocp.CheckpointManagerOptions())
    with pytest.raises(ValueError, match="num_global_devices=2"):
        cu.save_checkpoint(cp_manager=manager, step=1, model=model, optimizer=opt,
                           feature_specs=fs, num_global_devices=2, num_sc_per_device=4)


def test_converter_flags_and_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flags = offline_converter.parse_flags(["-input_checkpoint=/a", "--output_checkpoint", "b",
                                           "--target_num_devices=8"])
    assert (flags.input_checkpoint, flags.output_checkpoint, flags.target_num_devices,
            flags.target_device_kind, flags.target_global_batch_size) == ("/a", "b", 8,
                                                                           "TPU v5", None)
    with pytest.raises(SystemExit):
        offline_converter.parse_flags(["--input_checkpoint=/a"])
    with pytest.raises(SystemExit):
        offline_converter.parse_flags(["--input_checkpoint=/a", "--output_checkpoint=/b",
                                       "--target_num_devices=0"])
    device = offline_converter.FakeDevice(3, device_kind="TPU v6e")
    assert (device.id, device.platform, device.device_kind) == (3, "tpu", "TPU v6e")
    monkeypatch.setenv("TEST_UNDECLARED_OUTPUTS_DIR", str(tmp_path))
    assert offline_converter.expand_directory_path("gs://b/c") == "gs://b/c"
    assert offline_converter.expand_directory_path(
        "TEST_UNDECLARED_OUTPUTS_DIR/x/y") == str(tmp_path / "x" / "y")
    assert (tmp_path / "x" / "y").is_dir()
    assert offline_converter.expand_directory_path("TEST_UNDECLARED_OUTPUTS_DIR") == str(tmp_path)
    monkeypatch.delenv("TEST_UNDECLARED_OUTPUTS_DIR")
    with pytest.raises(ValueError, match="TEST_UNDECLARED_OUTPUTS_DIR"):
        offline_converter.expand_directory_path("TEST_UNDECLARED_OUTPUTS_DIR/x")
    with pytest.raises(ValueError, match="TEST_UNDECLARED_OUTPUTS_DIR"):
        cu.decompress_checkpoint(str(tmp_path / "a.tgz"))


def test_decompress_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                               saved: tuple[Path, dict, list]) -> None:
    archive = shutil.make_archive(str(tmp_path / "run"), "gztar", saved[0])
    tgz = Path(archive).rename(tmp_path / "run.tgz")
    monkeypatch.setenv("TEST_UNDECLARED_OUTPUTS_DIR", str(tmp_path / "out"))
    out = Path(cu.decompress_checkpoint(str(tgz)))
    assert out == tmp_path / "out" / "decompressed_checkpoints" / "run"
    assert (out / "2" / "embedding_spec" / "proto.pbtxt").is_file()
    (tmp_path / "bad.tgz").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match=r"bad\.tgz"):
        cu.decompress_checkpoint(str(tmp_path / "bad.tgz"))


@pytest.mark.skipif(not hasattr(tarfile, "data_filter"),
                    reason="this Python's tarfile has no extraction filters (3.11.4+)")
def test_decompress_checkpoint_keeps_members_inside(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """A hostile archive's member outside the output directory is refused, not written."""
    payload = tmp_path / "payload"
    payload.write_text("x")
    with tarfile.open(tmp_path / "evil.tgz", "w:gz") as tar:
        tar.add(payload, arcname="../../escaped")
    monkeypatch.setenv("TEST_UNDECLARED_OUTPUTS_DIR", str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"evil\.tgz.*outside"):
        cu.decompress_checkpoint(str(tmp_path / "evil.tgz"))
    assert not (tmp_path / "out" / "escaped").exists()


def test_public_names() -> None:
    import tilecore.compat.flax.nnx.checkpoint_utils as short

    import tilecore.compat.lib.flax.nnx as nnx_pkg

    assert nnx_pkg.checkpoint_utils is cu is short
    assert nnx_pkg.offline_converter is offline_converter
    for name in ("TargetTopology", "decompress_checkpoint", "create_checkpoint_manager",
                 "save_checkpoint", "restore_checkpoint", "restore_cross_topology_checkpoint",
                 "convert_cross_topology_checkpoint", "Nested"):
        assert name in cu.__all__ and hasattr(cu, name)
    assert cu.TargetTopology(2, 4) == (2, 4, None)


if __name__ == "__main__" and sys.argv[1] == "multidevice":
    _multidevice(Path(sys.argv[2]))


def test_save_checkpoint_refuses_a_step_orbax_would_skip(tmp_path: Path) -> None:
    """Orbax's manager skips a step at or below its latest, and save_checkpoint returned as
    if it had saved: the state of that call was lost in silence."""
    specs, model, optimizer = build(1, 2, 0)
    manager = cu.create_checkpoint_manager(cp_path=tmp_path / "run",
                                           cp_options=ocp.CheckpointManagerOptions())

    def save_at(step: object) -> None:
        cu.save_checkpoint(cp_manager=manager, step=step, model=model,  # type: ignore[arg-type]
                           optimizer=optimizer, feature_specs=specs, num_global_devices=1,
                           num_sc_per_device=2)

    save_at(5)
    manager.wait_until_finished()
    for step in (3, 5):
        with pytest.raises(ValueError, match=rf"step {step} would not be saved: .* already "
                                             r"holds step 5, and steps must increase"):
            save_at(step)
    with pytest.raises(ValueError, match=r"step must be an integer >= 0, got step=1\.5"):
        save_at(1.5)
    manager.close()
    path = str(tmp_path / "run")
    with pytest.raises(TypeError, match=r"save_checkpoint: cp_manager must be an orbax "
                                        r"CheckpointManager .*got str"):
        cu.save_checkpoint(cp_manager=path, step=9, model=model,  # type: ignore[arg-type]
                           optimizer=optimizer, feature_specs=specs, num_global_devices=1,
                           num_sc_per_device=2)
    with pytest.raises(TypeError, match="a path goes in input_checkpoint_path"):
        cu.restore_checkpoint(cp_manager=path, model=model,  # type: ignore[arg-type]
                              optimizer=optimizer)


def test_restore_steps_of_the_wrong_type_are_not_called_missing_or_damaged(
        saved: tuple[Path, dict, list]) -> None:
    """step='1' said 'Step 1 not found ... it has steps [1]'; 1.0 was read as a damaged '1.0'."""
    path, _, _ = saved
    _, model, optimizer = fresh(1, 4)
    for step in ("1", 1.0, True):
        with pytest.raises(TypeError, match=f"step must be an integer .* got step={step!r}"):
            cu.restore_checkpoint(input_checkpoint_path=path, step=step,  # type: ignore[arg-type]
                                  model=model, optimizer=optimizer)
