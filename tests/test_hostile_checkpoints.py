"""Damaged checkpoints: each case is an accident a user meets, and each must end in a
clear `CheckpointCorruptError` naming the step's directory and the array (or the
metadata file), or in the documented behaviour: resuming skips a damaged newest
checkpoint with a warning; Orbax's unfinished temporary directories are ignored;
checkpoints written before checksums still restore. Arrays spread over processes
carry a checksum that any sharding of them gives (`hashsum64`).

Checkpoints here are tiny (two stacks, one with an optimizer slot) so the file stays
fast; the training cases share one short run, copied before each is damaged.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tilecore as tc
import tilecore.checkpoint as ck
from tilecore import data
from tilecore.checkpoint import _checksums
from tilecore.checkpoint._hashsum import block_sum, local_sum
from tilecore_apps import dlrm as training
from tilecore_apps.cli import main

TINY_CLI = ["--batch-size", "64", "--vocab-sizes", "40,300,200,60", "--sc-per-device", "2",
            "--embedding-dim", "8", "--eval-batches", "1", "--tune-batches", "1",
            "--threads", "1", "--no-pipelining"]


def plan_for(sc: int = 2) -> tc.StackingPlan:
    """Two stacks: `a` (Adagrad: one slot) and `b` (SGD: none)."""
    a = tc.TableSpec(name="a", vocab_size=48, embedding_dim=8, optimizer=tc.Adagrad())
    b = tc.TableSpec(name="b", vocab_size=30, embedding_dim=4)
    features = [tc.FeatureSpec(name="fa", table=a, input_shape=(8, 1)),
                tc.FeatureSpec(name="fb", table=b, input_shape=(8, 1))]
    return tc.plan_stacking(features, tc.Topology(global_devices=1, sc_per_device=sc))


def states(plan: tc.StackingPlan, seed: int) -> dict[str, ck.TableState]:
    rng = np.random.default_rng(seed)
    return {name: ck.TableState(
        rng.standard_normal((t.vocab_size, t.embedding_dim)).astype(np.float32),
        tuple(rng.random((t.vocab_size, t.embedding_dim)).astype(np.float32) + 0.5
              for _ in t.optimizer.slot_names)) for name, t in plan.tables.items()}


def extra_for(seed: int) -> dict[str, Any]:
    params = {"w": jnp.full((2, 3), float(seed)), "b": jnp.arange(3.0) + seed}
    return {"params": params, "opt": optax.adam(1e-3).init(params), "step": seed}


def save(root: Path, step: int, seed: int | None = None) -> Path:
    plan = plan_for()
    seed = step if seed is None else seed
    return ck.save(root, plan, ck.shard_variables(plan, states(plan, seed)), step=step,
                   extra=extra_for(seed))


def data_files(step_dir: Path, item: str = "embeddings") -> list[Path]:
    """The files holding `item`'s array values (Orbax's OCDBT data files), largest first."""
    files = [p for p in step_dir.joinpath(item).glob("ocdbt.process_*/d/*") if p.is_file()]
    assert files, f"no data files under {step_dir / item}"
    return sorted(files, key=lambda p: -p.stat().st_size)


def assert_corrupt(error: ck.CheckpointCorruptError, step_dir: Path, *parts: str) -> None:
    message = str(error)
    for part in (f"step {step_dir.name} is damaged", str(step_dir), *parts):
        assert part in message, (part, message)


def assert_restores_exactly(root: Path, step: int, seed: int | None = None) -> None:
    plan = plan_for()
    restored = ck.restore(root, plan, step=step)
    got = ck.unshard_variables(plan, restored.variables)
    for name, want in states(plan, step if seed is None else seed).items():
        np.testing.assert_array_equal(got[name].table, want.table, err_msg=name)
        for g, w in zip(got[name].slots, want.slots, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=name)


def every_reader_refuses(root: Path, step: int, *parts: str) -> None:
    """restore (same and other layout), export_tables and verify all raise, alike."""
    step_dir = root / str(step)
    for read in (lambda: ck.restore(root, plan_for(), step=step),
                 lambda: ck.restore(root, plan_for(sc=4), step=step),  # converted on the host
                 lambda: ck.export_tables(root, step=step),
                 lambda: ck.verify(root, step=step)):
        with pytest.raises(ck.CheckpointCorruptError) as info:
            read()
        assert_corrupt(info.value, step_dir, *parts)


# --------------------------------------------------------------------------- array files


@pytest.mark.parametrize("what, dtype", [("table", "bfloat16"), ("table", "int32"),
                                         ("accumulator", "float16")])
def test_variables_of_another_dtype_are_refused_at_save(tmp_path: Path, what: str,
                                                        dtype: str) -> None:
    """A table in another dtype than the plan's, or a slot that is not float32, was saved;
    restored, the ops refused it. Refused when saving, naming the stack and array."""
    plan = plan_for()
    variables = ck.shard_variables(plan, states(plan, 0))
    a = variables["a"]
    a = (a._replace(table=a.table.astype(dtype)) if what == "table"
         else a._replace(slots=(a.slots[0].astype(dtype),)))
    with pytest.raises(ValueError, match=rf"Stack 'a': {what} is .*\({dtype}\); the plan "
                                         rf"stores it as float32"):
        ck.save(tmp_path / "ckpt", plan, {**variables, "a": a}, step=0)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_flipped_bytes_in_a_data_file_never_restore_other_values(tmp_path: Path) -> None:
    """A disk error flips bytes in the largest data file: each flip either raises naming
    the array or (bytes Orbax no longer uses) restores the saved values exactly."""
    step_dir = save(tmp_path, 3)
    target = data_files(step_dir)[0]
    original = target.read_bytes()
    caught = 0
    for offset in range(len(original) // 20, len(original) // 2, len(original) // 20):
        damaged = bytearray(original)
        damaged[offset:offset + 4] = bytes(b ^ 0x5A for b in damaged[offset:offset + 4])
        target.write_bytes(bytes(damaged))
        try:
            assert_restores_exactly(tmp_path, 3)
        except ck.CheckpointCorruptError as error:
            assert_corrupt(error, step_dir, "stack '", f"{step_dir}/embeddings")
            caught += "bytes changed after saving" in str(error)
    assert caught >= 3, "flips in the array values must be caught by the checksums"
    damaged = bytearray(original)
    damaged[len(original) // 4] ^= 0x5A
    target.write_bytes(bytes(damaged))
    every_reader_refuses(tmp_path, 3, "stack '", "bytes changed after saving")


@pytest.mark.parametrize("accident", ["truncated", "deleted", "emptied"])
def test_unreadable_data_file_names_the_array(tmp_path: Path, accident: str) -> None:
    """A copy stopped half-way (truncated), a cleanup script (deleted), a full disk
    (emptied): TensorStore's error becomes CheckpointCorruptError, chained."""
    step_dir = save(tmp_path, 5)
    target = data_files(step_dir)[0]
    if accident == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif accident == "deleted":
        target.unlink()
    else:
        target.write_bytes(b"")
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.restore(tmp_path, plan_for())
    assert_corrupt(info.value, step_dir, "stack '", "cannot be read from",
                   f"{step_dir}/embeddings")
    assert info.value.__cause__ is not None  # the TensorStore error, for the details
    every_reader_refuses(tmp_path, 5, "cannot be read from")


def test_arrays_copied_from_another_step_are_caught(tmp_path: Path) -> None:
    """Files mixed up between steps (a backup restored into the wrong directory) are
    valid arrays with other values: only the checksums can tell."""
    save(tmp_path, 1)
    step_dir = save(tmp_path, 2)
    for item, parts in (("embeddings", ("stack 'a' (tables ['a'])", "bytes changed")),
                        ("extra", ("extra leaf '", "bytes changed"))):
        backup = tmp_path / f"backup-{item}"
        shutil.copytree(step_dir / item, backup)
        shutil.rmtree(step_dir / item)
        shutil.copytree(tmp_path / "1" / item, step_dir / item)
        with pytest.raises(ck.CheckpointCorruptError) as info:
            ck.restore(tmp_path, plan_for(), step=2)
        assert_corrupt(info.value, step_dir, *parts)
        with pytest.raises(ck.CheckpointCorruptError):
            ck.verify(tmp_path, step=2)
        shutil.rmtree(step_dir / item)
        backup.rename(step_dir / item)
    assert_restores_exactly(tmp_path, 2)
    assert ck.verify(tmp_path) == 2


def test_damaged_array_index_names_the_item(tmp_path: Path) -> None:
    """Orbax's own record of the arrays (`_METADATA`) overwritten by a stray write."""
    step_dir = save(tmp_path, 4)
    (step_dir / "embeddings" / "_METADATA").write_text("\x00garbage")
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.restore(tmp_path, plan_for())
    assert_corrupt(info.value, step_dir, "'embeddings' arrays", f"{step_dir}/embeddings")


# --------------------------------------------------------------------------- metadata


@pytest.mark.parametrize(("accident", "why"), [
    ("binary garbage", "cannot be read"),
    ("empty", "cannot be read"),
    ("deleted", "cannot be read"),
    ("hand-edited value", "changed after saving"),
])
def test_damaged_metadata_names_the_file(tmp_path: Path, accident: str, why: str) -> None:
    step_dir = save(tmp_path, 6)
    path = step_dir / "tilecore" / "metadata"
    if accident == "binary garbage":
        path.write_bytes(bytes(range(256)))
    elif accident == "empty":
        path.write_bytes(b"")
    elif accident == "deleted":
        path.unlink()
    else:  # a learning rate "fixed" by hand: restore would not even read it
        meta = json.loads(path.read_text())
        meta["tables"]["a"]["optimizer"]["learning_rate"] = 0.5
        path.write_text(json.dumps(meta))
    for read in (lambda: ck.restore(tmp_path, plan_for()), lambda: ck.read_metadata(tmp_path),
                 lambda: ck.export_tables(tmp_path), lambda: ck.verify(tmp_path)):
        with pytest.raises(ck.CheckpointCorruptError) as info:
            read()
        assert_corrupt(info.value, step_dir, why, str(path), "saved steps: [6]")


# --------------------------------------------------------------------------- step directories


def test_empty_step_directory_is_damaged_and_resume_skips_it(tmp_path: Path) -> None:
    """`mkdir ckpt/9` (or a copy that never started): listed by Orbax, so restoring the
    latest says it is damaged; an explicit older step and resuming still work."""
    save(tmp_path, 1)
    (tmp_path / "9").mkdir()
    assert ck.available_steps(tmp_path) == (1, 9)
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.restore(tmp_path, plan_for())
    assert_corrupt(info.value, tmp_path / "9", "saved steps: [1, 9]")
    assert_restores_exactly(tmp_path, 1)
    with pytest.warns(UserWarning, match=r"damaged checkpoint step 9 .*resuming from step 1"):
        assert training.latest_step(tmp_path) == 1


def test_unfinished_save_directory_is_ignored(tmp_path: Path) -> None:
    """A save killed mid-way leaves Orbax's temporary directory: never a checkpoint,
    even when it holds every file (killed just before the final rename)."""
    save(tmp_path, 1)
    step_dir = save(tmp_path / "other", 2)
    shutil.copytree(step_dir, tmp_path / "2.orbax-checkpoint-tmp-1234")
    (tmp_path / "3.orbax-checkpoint-tmp-99").mkdir()
    assert ck.available_steps(tmp_path) == (1,)
    assert ck.restore(tmp_path, plan_for()).step == 1
    assert ck.read_metadata(tmp_path)["step"] == 1
    assert training.latest_step(tmp_path) == 1


def test_checkpoint_without_checksums_still_restores(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Checkpoints written before checksums (no `checksums` in the metadata) restore
    as before, extra included; only their shapes and readability are checked."""
    step_dir = save(tmp_path, 7)
    path = step_dir / "tilecore" / "metadata"
    meta = json.loads(path.read_text())
    assert meta["checksums"]["algorithm"] == "crc32"
    assert set(meta["checksums"]["embeddings"]["a"]["slots"]) == {"accumulator"}
    del meta["checksums"], meta["metadata_crc32"]
    path.write_text(json.dumps(meta))
    with caplog.at_level(logging.DEBUG, logger="tilecore.checkpoint"):
        assert_restores_exactly(tmp_path, 7)
    assert "records no checksums" in caplog.text
    extra = ck.restore(tmp_path, plan_for()).extra
    np.testing.assert_array_equal(extra["params"]["w"], np.full((2, 3), 7.0))
    assert ck.verify(tmp_path) == 7 and "checksums" not in ck.read_metadata(tmp_path)


# --------------------------------------------------------------------------- arrays spread over processes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool", "complex128", ">f8"])
def test_hashsum64_is_the_same_from_any_shards(dtype: str) -> None:
    """The sum over any tiling (rows, columns, both; as processes would hold them)
    is the whole array's; one flipped bit anywhere, or two swapped rows, change it."""
    numpy_dtype = jnp.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    whole = (np.random.default_rng(3).standard_normal((37, 6)) * 50).astype(numpy_dtype)
    want = local_sum(whole)
    assert want == block_sum(whole, (0, 0), whole.shape) < 2**64
    if dtype in ("float32", "bfloat16", "int8", "bool"):
        assert local_sum(jnp.asarray(whole)) == want  # a jax array's shards
    for row_parts, col_parts in ((4, 1), (37, 1), (1, 6), (3, 2), (5, 4)):
        total = 0
        for rows in np.array_split(np.arange(37), row_parts):
            for cols in np.array_split(np.arange(6), col_parts):
                tile = whole[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]
                total += block_sum(tile, (int(rows[0]), int(cols[0])), whole.shape)
        assert total % 2**64 == want, (row_parts, col_parts)
    size = whole.nbytes
    for offset in (0, size // 3, size - 1):
        flipped = whole.copy()
        flipped.reshape(-1).view(np.uint8)[offset] ^= 0x01
        assert local_sum(flipped) != want, offset
    swapped = whole.copy()
    swapped[[2, 9]] = swapped[[9, 2]]
    if not np.array_equal(swapped, whole):
        assert local_sum(swapped) != want


def test_arrays_spread_over_processes_are_checked(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays no process can gather get `hashsum64` records (here every jax array, as
    in a multi-process job): a one-device read checks them, and files of another step
    are refused by every reader, naming the array and both sums."""
    monkeypatch.setattr(_checksums, "_spans_processes", lambda v: isinstance(v, jax.Array))
    save(tmp_path, 1)
    step_dir = save(tmp_path, 2)
    checksums = ck.read_metadata(tmp_path)["checksums"]
    assert checksums["algorithm"] == "crc32"  # the format of gatherable arrays' records
    assert "hashsum64" in checksums["embeddings"]["a"]["table"]
    assert "hashsum64" in checksums["extra"]["params/w"]
    assert "crc32" in checksums["extra"]["step"]  # a Python int: on every host
    assert_restores_exactly(tmp_path, 2)
    monkeypatch.undo()  # read on the host, whole
    assert_restores_exactly(tmp_path, 2)
    assert ck.verify(tmp_path) == 2
    shutil.rmtree(step_dir / "embeddings")
    shutil.copytree(tmp_path / "1" / "embeddings", step_dir / "embeddings")
    every_reader_refuses(tmp_path, 2, "stack 'a' (tables ['a'])", "it reads as hashsum64 0x",
                         "but save recorded hashsum64 0x")


# --------------------------------------------------------------------------- resuming a run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[training.TrainResult, Path]:
    """A 4-step run saving at steps 2 and 4."""
    directory = tmp_path_factory.mktemp("run") / "checkpoint"
    config = training.TrainConfig(
        steps=4, eval_every=4, eval_batches=1, tune_batches=1, pipelining=False,
        topology=tc.Topology(global_devices=1, sc_per_device=2),
        model=training.ModelConfig(embedding_dim=8), checkpoint_dir=directory,
        checkpoint_every=2)
    result = training.train(_source(), config, progress=io.StringIO())
    assert ck.available_steps(directory) == (2, 4)
    return result, directory


def _source() -> data.ClickDataset:
    return data.clicks(seed=0, batch_size=64, vocab_sizes=(40, 300, 200, 60), multi_hot={2: 4})


def _damaged_copy(run: tuple[training.TrainResult, Path], tmp_path: Path, *steps: int) -> Path:
    directory = tmp_path / "checkpoint"
    shutil.copytree(run[1], directory)
    for step in steps:
        target = data_files(directory / str(step))[0]
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    return directory


def test_resume_falls_back_past_a_damaged_newest_checkpoint(
        run: tuple[training.TrainResult, Path], tmp_path: Path) -> None:
    result, _ = run
    directory = _damaged_copy(run, tmp_path, 4)
    with pytest.warns(UserWarning, match=r"Skipping the damaged checkpoint step 4 in .*"
                                         r"resuming from step 2, the newest intact one") as seen:
        resumed = training.restore_checkpoint(directory, result.plan, result.state.dense)
    skipped = [str(w.message) for w in seen if "Skipping" in str(w.message)]
    assert resumed.step == 2 and len(skipped) == 1 and str(directory / "4") in skipped[0]
    want = ck.restore(run[1], result.plan, step=2)
    for name, var in want.variables.items():
        np.testing.assert_array_equal(np.asarray(resumed.variables[name].table),
                                      np.asarray(var.table))
    assert training.latest_step(directory) == 2  # the verdict is remembered: no second warning


def test_explicit_damaged_step_raises_without_fallback(
        run: tuple[training.TrainResult, Path], tmp_path: Path) -> None:
    result, _ = run
    directory = _damaged_copy(run, tmp_path, 4)
    with pytest.raises(ck.CheckpointCorruptError) as info:
        training.restore_checkpoint(directory, result.plan, result.state.dense, step=4)
    assert_corrupt(info.value, directory / "4", "stack '", "cannot be read from")
    assert training.restore_checkpoint(directory, result.plan, result.state.dense,
                                       step=2).step == 2


def test_every_checkpoint_damaged_is_one_clear_error(
        run: tuple[training.TrainResult, Path], tmp_path: Path) -> None:
    result, _ = run
    directory = _damaged_copy(run, tmp_path, 2, 4)
    for resume in (lambda: training.latest_step(directory),
                   lambda: training.restore_checkpoint(directory, result.plan,
                                                       result.state.dense)):
        with pytest.raises(ck.CheckpointCorruptError) as info:
            resume()
        message = str(info.value)
        for part in (f"No intact checkpoint to resume from in {str(directory)!r}",
                     "  - step 4: ", "  - step 2: ", "Move the damaged step directories away"):
            assert part in message, (part, message)


def test_cli_resume_skips_a_damaged_checkpoint_and_saves_that_step_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tilecore train --resume` after the newest checkpoint was damaged: it warns,
    trains on from the older one, moves the damaged step aside and saves it anew."""
    out = tmp_path / "run"
    base = ["train", *TINY_CLI, "--out", str(out)]
    assert main([*base, "--steps", "4", "--checkpoint-every", "2"]) == 0
    target = data_files(out / "checkpoint" / "4")[0]
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    capsys.readouterr()
    with pytest.warns(UserWarning) as seen:
        assert main([*base, "--resume", "--steps", "2"]) == 0
    messages = [str(w.message) for w in seen]
    assert any("Skipping the damaged checkpoint step 4" in m and "resuming from step 2" in m
               for m in messages), messages
    assert any(f"Moved the damaged checkpoint step 4 to {str(out / 'checkpoint' / '4.damaged')!r}"
               in m for m in messages), messages
    printed = capsys.readouterr().out
    assert "steps 3-4" in printed and "resumed from step 2" in printed, printed
    assert ck.available_steps(out / "checkpoint") == (2, 4)
    assert ck.verify(out / "checkpoint") == 4

    # A shorter resume past a damaged newest step saves its own step (3): the damaged
    # 4 is moved aside first (Orbax skipped a step older than the newest in silence).
    target = data_files(out / "checkpoint" / "4")[0]
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    with pytest.warns(UserWarning) as seen:
        assert main([*base, "--resume", "--steps", "1"]) == 0
    assert any("Moved the damaged checkpoint step 4" in str(w.message) for w in seen)
    assert ck.available_steps(out / "checkpoint") == (2, 3)
    capsys.readouterr()

    for step in (2, 3):  # now every checkpoint is damaged: an error, no training
        target = data_files(out / "checkpoint" / str(step))[0]
        target.write_bytes(b"")
    assert main([*base, "--resume", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "tilecore train: error: No intact checkpoint to resume from" in err, err


def test_fresh_run_into_damaged_checkpoints_is_refused(
        run: tuple[training.TrainResult, Path], tmp_path: Path) -> None:
    """Training without resume into a directory whose checkpoints are all damaged
    stops before training, saying so (it would otherwise mix with them)."""
    directory = _damaged_copy(run, tmp_path, 2, 4)
    config = dataclasses.replace(training.TrainConfig(
        steps=4, eval_batches=1, tune_batches=1,
        topology=tc.Topology(global_devices=1, sc_per_device=2),
        model=training.ModelConfig(embedding_dim=8)), checkpoint_dir=directory)
    with pytest.raises(ck.CheckpointCorruptError, match="No intact checkpoint"):
        training.train(_source(), config, progress=io.StringIO())


def test_user_mistakes_on_an_intact_checkpoint_are_not_called_damage(tmp_path: Path) -> None:
    """A restore target of another structure, or a step of the wrong type, is the caller's
    mistake: a ValueError / TypeError saying so, never `CheckpointCorruptError` (whose advice,
    to move the checkpoint away, would lose a good one). `max_to_keep=0` would delete the
    step just saved: refused before anything is written."""
    save(tmp_path, 5)
    with pytest.raises(ValueError, match=r"the target does not fit the tree saved in .*/5/extra"
                                         r"': it lacks the saved leaves \['opt"):
        ck.restore(tmp_path, plan_for(), extra={"params": extra_for(5)["params"]})
    wider = extra_for(5)
    wider["params"] = {**wider["params"], "w": jnp.zeros((4, 3))}  # another model's dense layer
    with pytest.raises(ck.CheckpointTargetError, match=r"leaves of other shapes: 'params/w' "
                                                       r"saved \(2, 3\), the target's \(4, 3\)"):
        ck.restore(tmp_path, plan_for(), extra=wider)
    for step in ("5", 5.0, True):
        with pytest.raises(TypeError, match=f"step must be an integer .* got step={step!r}"):
            ck.restore(tmp_path, plan_for(), step=step)  # type: ignore[arg-type]
    assert ck.restore(tmp_path, plan_for(), step=np.int64(5)).step == 5
    assert ck.verify(tmp_path) == 5  # nothing was damaged
    plan = plan_for()
    for keep in (0, -1, 1.5):
        with pytest.raises(ValueError, match=f"max_to_keep must be an integer >= 1 or None .keep all., "
                                             f"got max_to_keep={keep!r}"):
            ck.save(tmp_path / "new", plan, ck.shard_variables(plan, states(plan, 0)), step=0,
                    max_to_keep=keep)  # type: ignore[arg-type]
    assert not (tmp_path / "new").exists()


def test_extra_leaves_and_export_paths_that_cannot_be_written(tmp_path: Path) -> None:
    """A function in extra failed inside Orbax (and its threads printed tracebacks at exit);
    an npz_path in a missing directory, or a directory, named a hidden temporary file."""
    plan = plan_for()
    variables = ck.shard_variables(plan, states(plan, 0))
    with pytest.raises(TypeError, match=r"save: extra\['fn'\] is a function; extra may hold "
                                        "arrays, numbers and strings only"):
        ck.save(tmp_path / "run", plan, variables, step=0, extra={"fn": lambda x: x})
    assert not (tmp_path / "run").exists() or not ck.available_steps(tmp_path / "run")
    ck.save(tmp_path / "run", plan, variables, step=0, extra={"name": "run-1", "n": 3})
    for bad in (tmp_path / "missing" / "x.npz", tmp_path):
        with pytest.raises(ValueError, match=r"npz_path=.* must name a file in an existing "
                                             r"directory"):
            ck.export_tables(tmp_path / "run", npz_path=bad)


def test_steps_deleted_while_being_read_are_not_called_damaged(tmp_path: Path) -> None:
    """A reader racing a training run that prunes to its newest few saw intact steps
    called damaged, or bare FileNotFoundErrors from inside Orbax."""
    from tilecore.checkpoint._store import corrupt

    save(tmp_path, 8)
    gone = tmp_path / "6"
    other = corrupt(tmp_path, 8, f"its metadata cannot be read (FileNotFoundError: [Errno 2] "
                                 f"No such file or directory: '{gone}')")
    assert isinstance(other, ck.CheckpointNotFoundError)
    assert f"{str(gone)!r} was removed while step 8 was being read: another process deletes " \
           "checkpoints in this directory" in str(other)
    itself = corrupt(tmp_path, 9, "its arrays cannot be read (not found at path: ...)")
    assert isinstance(itself, ck.CheckpointNotFoundError) and "step 9" in str(itself)
    inside = corrupt(tmp_path, 8, f"No such file or directory: '{tmp_path / '8' / 'x'}'")
    assert isinstance(inside, ck.CheckpointCorruptError)  # a file of the step itself is gone
