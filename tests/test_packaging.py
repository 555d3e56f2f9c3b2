"""The install is lean and honest: runtime dependencies are exactly what `src/` imports."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Import name → distribution name, where they differ.
DISTRIBUTIONS = {"orbax": "orbax-checkpoint", "google": "protobuf"}
# Imported only by optional parts, each needing an extra: tilecore.testing's strategies.
OPTIONAL = {"hypothesis": "dev"}


def _imported_distributions() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "src").rglob("*.py"):  # tilecore and tilecore_apps
        if "peers" in path.parts:  # scripts that a peer engine's own Python runs
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    third_party = names - set(sys.stdlib_module_names) - {"tilecore", "tilecore_apps",
                                                           "__future__"}
    return {DISTRIBUTIONS.get(name, name) for name in third_party}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_runtime_dependencies_are_what_src_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _names(project["dependencies"])
    imported = _imported_distributions()
    assert declared == imported - set(OPTIONAL), (
        f"declared but never imported: {sorted(declared - imported)}; imported but not "
        f"declared: {sorted(imported - set(OPTIONAL) - declared)}")
    for name, extra in OPTIONAL.items():
        assert name in imported and name in _names(project["optional-dependencies"][extra])
    assert "scipy" in _names(project["optional-dependencies"]["dev"])  # the tests use it


def test_license_and_changelog_ship() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the full text, not a stub
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text()


def _make(tmp: Path, target: str) -> list[str]:
    """Run `make target` in `tmp` with fake tools; what pip and tilecore were asked to do."""
    log = tmp / "log"
    log.write_text("")
    subprocess.run(["make", "-s", target], cwd=tmp, check=True, capture_output=True)
    return [line for line in log.read_text().splitlines() if "pip" in line or "tilecore" in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_and_test_install_what_they_need_in_any_order(tmp_path: Path) -> None:
    """`make demo` installs the runtime only, `make test` adds the dev extra; neither
    reinstalls what is installed, in either order, until pyproject.toml changes."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "tilecore", "ruff", "pyright"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/log"\n')
        (bin_dir / tool).chmod(0o755)
    past = time.time() - 100
    os.utime(tmp_path / "pyproject.toml", (past, past))
    runtime = "python -m pip install --quiet -e ."
    dev, demo = f"{runtime}[dev]", "tilecore train"
    assert _make(tmp_path, "demo") == [runtime, demo]
    assert _make(tmp_path, "demo") == [demo]  # again: no install, a new run
    assert _make(tmp_path, "test") == [dev]  # demo then test: the dev extra
    assert _make(tmp_path, "demo") == [demo]
    os.utime(tmp_path / "pyproject.toml")  # the metadata changed: both reinstall once
    for stamp in (tmp_path / ".venv").glob(".installed*"):
        os.utime(stamp, (past + 50, past + 50))
    assert _make(tmp_path, "test") == [dev]
    assert _make(tmp_path, "demo") == [demo]  # test then demo: nothing more to install
    assert _make(tmp_path, "test") == []
