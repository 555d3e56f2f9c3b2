"""Running code in the real reference (jax-tpu-embedding 0.2.0), for differential tests.

The reference is never a tilecore dependency: it lives in its own Python 3.12
virtual environment, built by `make reference-test` at `.venv-reference/` (or named by
`$TILECORE_REFERENCE_PYTHON`). Tests that need it carry `requires_reference` and
are skipped, with that reason, where the venv is absent. The peer runs in a
subprocess; inputs and outputs travel as files in a working folder the test owns
(`.npz`, `.json`, serialized protos), so neither side imports the other's objects.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE_VERSION = "0.2.0"


def reference_python() -> pathlib.Path | None:
    """The reference venv's interpreter, or None when it is not built."""
    named = os.environ.get("TILECORE_REFERENCE_PYTHON")
    path = pathlib.Path(named) if named else ROOT / ".venv-reference" / "bin" / "python"
    return path if path.exists() else None


requires_reference = pytest.mark.skipif(
    reference_python() is None,
    reason=f"the reference (jax-tpu-embedding=={REFERENCE_VERSION}) venv is absent; "
    "`make reference-test` builds it (Python 3.12) and runs these tests",
)


def run_reference(code: str, workdir: pathlib.Path, *, timeout: float = 300) -> str:
    """Run `code` in the reference venv with `WORKDIR` (a `pathlib.Path`) bound; return stdout.

    The code reads its inputs from and writes its outputs to `WORKDIR`. JAX runs on
    the CPU there (the reference's host-side modules need no TPU).
    """
    python = reference_python()
    if python is None:
        pytest.skip("the reference venv is absent")
    prelude = f"import pathlib\nWORKDIR = pathlib.Path({str(workdir)!r})\n"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ""}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [str(python), "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
        env=env, cwd=workdir, timeout=timeout, check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"the reference failed:\n{result.stderr[-4000:]}")
    return result.stdout
