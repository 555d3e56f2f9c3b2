"""The library's packages import only packages to their left in the data flow (DESIGN.md),
and never the applications: every `import` counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parent.parent / "src"

LAYERS = [
    ["_numba", "_host"],
    ["specs"],
    ["stacking", "optimizers"],
    ["preprocessing"],
    ["distributed"],
    ["ops", "data", "testing", "fdo"],
    ["layers", "pipelining"],
    ["checkpoint", "compat"],
]
"""Left to right: a package may import its own layer's and those to its left."""
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def _imported_packages(path: Path) -> list[tuple[str, int]]:
    """(first component under `tilecore`, or `tilecore_apps`; line) of each import."""
    parts = path.relative_to(SRC / "tilecore").parts
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = list(parts[:-1])[:len(parts) - node.level]
                module = [*base, *(node.module.split(".") if node.module else [])]
                names = ["tilecore." + ".".join(module or [node.names[0].name])]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            top, _, rest = name.partition(".")
            if top == "tilecore_apps":
                found.append(("tilecore_apps", node.lineno))
            elif top == "tilecore" and rest:
                found.append((rest.split(".")[0], node.lineno))
    return found


def test_packages_import_only_to_their_left_and_never_the_applications() -> None:
    wrong = []
    for path in sorted((SRC / "tilecore").rglob("*.py")):
        package = path.relative_to(SRC / "tilecore").parts[0].removesuffix(".py")
        if package not in LEVEL:
            continue  # the package's __init__ (the public API) may import any of them
        for target, line in _imported_packages(path):
            target = target.removesuffix(".py")
            if target == "tilecore_apps" or LEVEL.get(target, -1) > LEVEL[package]:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in (SRC / "tilecore").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in (SRC / "tilecore").glob("_*.py") if p.stem != "__init__"}
    assert packages | modules == set(LEVEL)
