"""The library never imports its applications; the applications use only its public API.

`src/tilecore/` is the library; `src/tilecore_apps/` holds what is built on it (the
DLRM trainer, the benchmarks, the `tilecore` command), as a user's code would be.
"""

from __future__ import annotations

import ast
import importlib
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
LIBRARY, APPS = "tilecore", "tilecore_apps"


def _imports(package: str) -> Iterator[tuple[str, int, str, list[str]]]:
    """(file, line, absolute module, imported names) of every import under `src/package`."""
    for path in sorted((SRC / package).rglob("*.py")):
        name = str(path.relative_to(SRC))
        package = path.relative_to(SRC).parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield name, node.lineno, alias.name, []
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against the importing module's package
                    base = package[: len(package) + 1 - node.level]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                yield name, node.lineno, module, [alias.name for alias in node.names]


def test_the_library_never_imports_its_applications() -> None:
    found = [f"{path}:{line}: {module}" for path, line, module, names in _imports(LIBRARY)
             if module.split(".")[0] == APPS]
    assert not found, f"the library imports the applications: {found}"


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


def test_the_applications_use_only_the_public_api() -> None:
    """No `tilecore._x` or `tilecore.y._z` module, and every name imported from a
    tilecore module is in its `__all__` (or is a public subpackage)."""
    found = []
    for path, line, module, names in _imports(APPS):
        if module.split(".")[0] != LIBRARY:
            continue
        if _private(module):
            found.append(f"{path}:{line}: {module}")
            continue
        exported = importlib.import_module(module)
        for name in names:
            value = getattr(exported, name, None)
            if isinstance(value, types.ModuleType) or name not in getattr(exported, "__all__", ()):
                try:
                    is_public_module = not name.startswith("_") and isinstance(
                        importlib.import_module(f"{module}.{name}"), types.ModuleType)
                except ModuleNotFoundError:
                    is_public_module = False
                if not is_public_module:
                    found.append(f"{path}:{line}: from {module} import {name}")
    assert not found, f"the applications use tilecore's private names: {found}"


@pytest.mark.parametrize("module, private", [
    ("tilecore", False), ("tilecore.ops", False), ("tilecore._typing", True),
    ("tilecore.ops._layout", True), ("tilecore.compat.lib.nn", False),
])
def test_private_is_any_underscored_part(module: str, private: bool) -> None:
    assert _private(module) is private


def test_imports_are_resolved_relative_to_their_package() -> None:
    modules = {module for path, _, module, _ in _imports(APPS) if path.endswith("cli/_main.py")}
    assert {"tilecore_apps", "tilecore_apps.cli"} <= modules  # `from .. import bench`, `from .`


@pytest.mark.parametrize("package", ["tilecore_apps.dlrm", "tilecore_apps.bench",
                                     "tilecore_apps.cli"])
def test_every_application_name_in_all_is_importable(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__ and len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        getattr(module, name)
