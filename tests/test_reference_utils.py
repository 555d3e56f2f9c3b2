"""`tilecore.compat.utils.utils` and `lib.core.input_preprocessing` against the live reference.

The reference (jax-tpu-embedding 0.2.0, in its own venv) computes the sharded
tables, the preprocessing estimates, the SparseCore counts of TPU device kinds and
the one-feature CSR buffers for the same inputs; tilecore's must be equal.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types

import numpy as np
import pytest

from _reference_peer import requires_reference, run_reference
from tilecore.compat.lib.core import input_preprocessing
from tilecore.compat.utils import utils

pytestmark = requires_reference


@dataclasses.dataclass
class _Device:
    device_kind: str

SHARD_CASES = [((64, 3), 2, 4), ((16,), 1, 2), ((32, 2, 2), 4, 2), ((8, 4), 8, 1)]
ESTIMATE_CASES = [
    {"global_batch_size": 4096, "global_device_count": 8, "num_sc_per_device": 4, "valency": 10.0},
    {"global_batch_size": 1000, "global_device_count": 4, "num_sc_per_device": 2, "valency": 2.5,
     "hot_shard_fraction": 0.05, "headroom_factor": 2.0},
    {"global_batch_size": 64, "global_device_count": 1, "num_sc_per_device": 4, "valency": 1},
]

REFERENCE_CODE = """
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np
from jax_tpu_embedding.sparsecore.utils import utils
from jax_tpu_embedding.sparsecore.lib.core import input_preprocessing
cases = json.loads((WORKDIR / "cases.json").read_text())
tables = np.load(WORKDIR / "tables.npz")
out = {}
for i, (shape, devices, sc) in enumerate(cases["shard"]):
    sharded = utils.shard_emb_table(tables[f"t{i}"], num_devices=devices, num_sc_per_device=sc)
    out[f"sharded{i}"] = np.asarray(sharded)
    out[f"unsharded{i}"] = np.asarray(utils.unshard_emb_table(sharded, sc))
class Device:
    def __init__(self, kind): self.device_kind = kind
counts = {k: utils.num_sparsecores_per_device(Device(k)) for k in cases["kinds"]}
estimates = [utils.estimate_preprocessing_parameters(**c) for c in cases["estimate"]]
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
for name, (feats, weights) in cases["preprocess"].items():
    arrays = input_preprocessing.preprocess_sparse_dense_matmul_input(
        feats, weights, mesh, max_ids_per_partition=8, max_unique_ids_per_partition=8,
        num_sc_per_device=2)
    for j, a in enumerate(arrays):
        out[f"{name}_{j}"] = np.asarray(a)
feats, weights = cases["minibatches"]
arrays = input_preprocessing.preprocess_sparse_dense_matmul_input(
    feats, weights, mesh, max_ids_per_partition=8, max_unique_ids_per_partition=8,
    num_sc_per_device=2, enable_minibatching=True)
for j, a in enumerate(arrays):
    out[f"minibatches_{j}"] = np.asarray(a)
np.savez(WORKDIR / "out.npz", **out)
(WORKDIR / "out.json").write_text(json.dumps({"counts": counts, "estimates": estimates}))
"""


def _preprocess_cases() -> dict[str, tuple[list[list[int]], list[list[float]]]]:
    rng = np.random.default_rng(7)
    cases = {}
    for name, vocab in (("small", 20), ("wide", 200)):
        rows = [rng.integers(0, vocab, rng.integers(0, 4)).tolist() for _ in range(8)]
        weights = [rng.uniform(0.5, 2.0, len(r)).round(3).tolist() for r in rows]
        cases[name] = (rows, weights)
    cases["dense"] = (rng.integers(0, 30, (4, 2)).tolist(), np.ones((4, 2)).tolist())
    return cases


def _minibatch_cases() -> tuple[list, list]:
    """Three minibatches of 8 ragged rows (some empty), as a caller splits a batch."""
    rng = np.random.default_rng(9)
    feats, weights = [], []
    for _ in range(3):
        rows = [rng.integers(0, 50, rng.integers(0, 3)).tolist() for _ in range(8)]
        feats.append(rows)
        weights.append([rng.uniform(0.5, 2.0, len(r)).round(3).tolist() for r in rows])
    return feats, weights


def test_utils_and_core_preprocessing_match_the_reference(tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(3)
    tables = {f"t{i}": rng.normal(size=shape).astype(np.float32)
              for i, (shape, _, _) in enumerate(SHARD_CASES)}
    np.savez(tmp_path / "tables.npz", **tables)
    kinds = sorted(utils.NUM_SC_PER_DEVICE_MAP)
    preprocess_cases = _preprocess_cases()
    (tmp_path / "cases.json").write_text(json.dumps({
        "shard": SHARD_CASES, "kinds": kinds, "estimate": ESTIMATE_CASES,
        "preprocess": preprocess_cases, "minibatches": _minibatch_cases()}))
    run_reference(REFERENCE_CODE, tmp_path)
    ref = np.load(tmp_path / "out.npz")
    ref_json = json.loads((tmp_path / "out.json").read_text())

    for i, (_, devices, sc) in enumerate(SHARD_CASES):
        sharded = utils.shard_emb_table(tables[f"t{i}"], num_devices=devices,
                                        num_sc_per_device=sc)
        np.testing.assert_array_equal(sharded, ref[f"sharded{i}"], err_msg=f"case {i}")
        np.testing.assert_array_equal(utils.unshard_emb_table(ref[f"sharded{i}"], sc),
                                      ref[f"unsharded{i}"], err_msg=f"case {i}")
    assert {k: utils.num_sparsecores_per_device(_Device(k))
            for k in kinds} == ref_json["counts"]
    assert [utils.estimate_preprocessing_parameters(**c)
            for c in ESTIMATE_CASES] == ref_json["estimates"]

    mesh = types.SimpleNamespace(size=4, devices=np.zeros(4))  # 4 devices, as the reference's
    for name, (feats, weights) in preprocess_cases.items():
        ours = input_preprocessing.preprocess_sparse_dense_matmul_input(
            np.asarray(feats) if name == "dense" else feats,
            np.asarray(weights, np.float32) if name == "dense" else weights,
            mesh, max_ids_per_partition=8, max_unique_ids_per_partition=8,  # type: ignore[arg-type]
            num_sc_per_device=2)
        for j, array in enumerate(ours):
            want = ref[f"{name}_{j}"]
            assert np.asarray(array).dtype == want.dtype, (name, j)
            np.testing.assert_allclose(np.asarray(array), want, rtol=1e-6,
                                       err_msg=f"{name} buffer {j}")
    feats, weights = _minibatch_cases()
    ours = input_preprocessing.preprocess_sparse_dense_matmul_input(
        feats, weights, mesh, max_ids_per_partition=8, max_unique_ids_per_partition=8,  # type: ignore[arg-type]
        num_sc_per_device=2, enable_minibatching=True)
    for j, array in enumerate(ours):
        want = ref[f"minibatches_{j}"]
        assert np.asarray(array).shape == want.shape and np.asarray(array).dtype == want.dtype
        np.testing.assert_allclose(np.asarray(array), want, rtol=1e-6,
                                   err_msg=f"minibatches buffer {j}")


@pytest.mark.parametrize("kind", ["TPU v4", "TPU v3"])
def test_unknown_tpu_kinds_raise_as_in_the_reference(kind: str) -> None:
    with pytest.raises(ValueError, match="Unknown sparsecore count"):
        utils.num_sparsecores_per_device(_Device(kind))
