"""Short import paths that are the very module objects of the mirrored tree.

`tilecore.compat.embedding` *is* `tilecore.compat.lib.nn.embedding` (not a copy
that re-exports it), so state set through one path — a monkeypatch in a test, a
`isinstance` check, a pickle — is seen through the other. A finder on
`sys.meta_path` answers the short names by importing the tree's module, lazily,
so `import tilecore.compat` still imports neither JAX nor Flax.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self._target = target
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias's spec on the module; give it back its own.
        module.__spec__ = self._own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self, aliases: Mapping[str, str]) -> None:
        self._aliases = dict(aliases)

    def target(self, fullname: str) -> str | None:
        for alias, target in self._aliases.items():
            if fullname == alias or fullname.startswith(alias + "."):
                return target + fullname[len(alias):]
        return None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        del path, target
        real = self.target(fullname)
        if real is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real))


def install(aliases: Mapping[str, str]) -> None:
    """Answer each `alias` (and its submodules) with the module at `target`."""
    if not any(isinstance(f, _AliasFinder) and f._aliases == dict(aliases) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(aliases))


def submodule_getattr(package: str, submodules: Sequence[str]):  # module hook: returns `__getattr__`
    """A module `__getattr__` that imports `package`'s listed submodules on first use.

    A mirrored package lists its submodules in `__all__` without importing them (some
    import JAX or Flax); `from package import submodule` and `package.submodule` work
    either way.
    """
    names = frozenset(submodules)

    def __getattr__(name: str) -> ModuleType:
        if name in names:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
