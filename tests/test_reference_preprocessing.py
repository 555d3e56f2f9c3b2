"""Stacking and host preprocessing against the live reference (jax-tpu-embedding 0.2.0).

The golden fixtures under `tests/fixtures/reference/` were written by the
reference; `test_compat.py`, `test_reference_fixtures.py` and
`test_minibatching_host.py` check compat and the native API against them on
every run. Here the same generator (`tools/make_reference_fixtures.py`) runs in
the 0.2.0 venv, and (1) every case it writes must equal the committed fixture
(so everything checked against the fixtures holds for 0.2.0 too), and (2) compat
is run on the freshly written cases directly: stacking, buffers and statistics.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from _reference_peer import ROOT, requires_reference, run_reference
from test_compat import (
    FIXTURE_CASES,
    FIXTURES,
    assert_equals_fixture,
    fixture_call,
    fixture_specs,
)
from tilecore.compat import embedding

pytestmark = requires_reference

MINIBATCHING_CASES = sorted(p.stem for p in (FIXTURES / "minibatching").glob("*.json"))
GENERATOR = ROOT / "tools" / "make_reference_fixtures.py"
# Metadata the generator gained after the committed fixtures were written.
NEWER_KEYS = frozenset({"enable_minibatching", "num_minibatches"})


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("reference-0.2.0")
    run_reference(f"""
        import importlib.metadata, runpy, sys
        version = importlib.metadata.version("jax-tpu-embedding")
        assert version == "0.2.0", version
        sys.argv = ["make_reference_fixtures.py", "--out", str(WORKDIR)]
        runpy.run_path({str(GENERATOR)!r}, run_name="__main__")
    """, out)
    return out


def _same_case(committed: pathlib.Path, fresh: pathlib.Path, case: str) -> None:
    old = json.loads((committed / f"{case}.json").read_text())
    new = json.loads((fresh / f"{case}.json").read_text())
    for key in set(old) | set(new):
        if key not in NEWER_KEYS:
            assert old.get(key) == new.get(key), f"{case}: {key}"
    with np.load(committed / f"{case}.npz") as a, np.load(fresh / f"{case}.npz") as b:
        assert sorted(a.files) == sorted(b.files), case
        for key in a.files:
            assert a[key].dtype == b[key].dtype, f"{case}: {key}"
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{case}: {key}")


@pytest.mark.parametrize("case", FIXTURE_CASES)
def test_reference_020_writes_the_committed_fixture(live: pathlib.Path, case: str) -> None:
    _same_case(FIXTURES, live, case)


@pytest.mark.parametrize("case", MINIBATCHING_CASES)
def test_reference_020_writes_the_committed_minibatching_fixture(
        live: pathlib.Path, case: str) -> None:
    _same_case(FIXTURES / "minibatching", live / "minibatching", case)


@pytest.mark.parametrize("case", [c for c in FIXTURE_CASES if c != "mean_zero_weight_sum"])
def test_compat_equals_live_reference(live: pathlib.Path, case: str,
                                      recwarn: pytest.WarningsRecorder) -> None:
    meta = json.loads((live / f"{case}.json").read_text())
    with np.load(live / f"{case}.npz") as z:
        arrays = dict(z)
    features = fixture_specs(meta)
    preprocessed, stats = fixture_call(meta, arrays, features)
    assert_equals_fixture(meta, arrays, preprocessed, stats, case)
    sizes = embedding.compute_coo_buffer_size_per_device(
        features, meta["topology"]["global_devices"], meta["topology"]["sc_per_device"])
    assert {n: meta["buffer_sizes"][n]["coo_size_per_device"] for n in sizes} == sizes
