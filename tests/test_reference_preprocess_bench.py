"""`benchmarks/preprocess_vs_reference.py` at a tiny size, so the side-by-side benchmark
cannot rot: it runs in the reference venv with tilecore's sources on the path (which
needs numba there: `.venv-reference/bin/pip install numba`; skipped without it)."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from _reference_peer import ROOT, reference_python, requires_reference, run_reference


def _has_numba() -> bool:
    python = reference_python()
    return python is not None and subprocess.run(
        [str(python), "-c", "import numba"], capture_output=True, check=False).returncode == 0


@requires_reference
@pytest.mark.parametrize("form", ["object-array", "dense"])
def test_the_side_by_side_benchmark_runs(form: str, tmp_path: pathlib.Path) -> None:
    if not _has_numba():
        pytest.skip("numba is not installed in the reference venv (tilecore's kernels need it)")
    run_reference(f"""
        import sys
        sys.path[:0] = [{str(ROOT / "src")!r}, {str(ROOT / "benchmarks")!r}]
        import preprocess_vs_reference as bench
        bench.main(["--workload", "criteo", "--batch-size", "64", "--batches", "1",
                    "--warmup", "0", "--repeats", "1", "--input-form", {form!r},
                    "--json", str(WORKDIR / "out.json")])
    """, tmp_path)
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["input_form"] == form
    assert report["stacks_match"] and report["limits_match"] and report["stats_match"]
    assert report["reference"]["median_s"] > 0 and report["tilecore"]["median_s"] > 0
