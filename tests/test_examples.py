"""Every script in examples/ runs at a tiny size, so the examples cannot rot.

Each runs in its own subprocess (as a user runs it: `python examples/<name>.py`),
with warnings as errors, and must exit 0 and print its success line, which it
prints only after its own checks (loss going down, numbers matching numpy or a
one-device run) have passed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUNS: dict[str, list[str]] = {
    "quickstart": ["--tiny"],
    "custom_optimizer": ["--tiny"],
    "port_from_reference": ["--tiny"],
    "flax_linen": ["--tiny"],
    # These scripts set the simulated device count themselves, before JAX starts.
    "multi_device": ["--tiny", "--devices", "2", "--sc-per-device", "2"],
    "checkpoint_topology": ["--tiny"],
}


def run_example(name: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", TILECORE_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-W", "error", str(EXAMPLES / f"{name}.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name: str) -> None:
    done = run_example(name, RUNS[name])
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert re.search(rf"^{name}: OK \(.*loss [0-9.]+ -> [0-9.]+\)$", done.stdout, re.M), (
        f"{name} printed no success line:\n{done.stdout}")


def test_every_example_is_run_and_documented() -> None:
    scripts = {path.stem for path in EXAMPLES.glob("*.py")}
    assert scripts == set(RUNS), f"run by this test: {sorted(RUNS)}; in examples/: {sorted(scripts)}"
    readme = (EXAMPLES / "README.md").read_text()
    missing = sorted(name for name in scripts if f"{name}.py" not in readme)
    assert not missing, f"examples/README.md does not describe {missing}"
