"""A tiny pytree flatten (dicts, lists, tuples, leaves) so compat need not import JAX.

It follows `jax.tree` for the containers reference users pass: a `dict`'s keys
are visited in sorted order (an `OrderedDict` keeps its insertion order), and so
are those of any other `Mapping` (`flax.core.FrozenDict`, which the reference's
example configs return, flattens in sorted key order too); lists and tuples
(named tuples included) in order, `None` is an empty subtree, and anything else
(numpy arrays, specs) is a leaf.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, cast

Path = tuple[object, ...]


def _children(tree: Any) -> list[tuple[object, Any]] | None:
    """`(key, child)` pairs of a container, or None for a leaf."""
    if isinstance(tree, OrderedDict):
        return list(tree.items())
    if isinstance(tree, Mapping):
        return [(key, tree[key]) for key in sorted(tree)]
    if isinstance(tree, list | tuple):
        return list(enumerate(tree))
    return None


def leaves_with_paths(tree: Any) -> list[tuple[Path, Any]]:
    """Every leaf with the keys that lead to it, in `jax.tree.leaves` order."""
    out: list[tuple[Path, Any]] = []

    def visit(node: Any, path: Path) -> None:
        if node is None:
            return
        children = _children(node)
        if children is None:
            out.append((path, node))
            return
        for key, child in children:
            visit(child, (*path, key))

    visit(tree, ())
    return out


def leaves(tree: Any) -> list[Any]:
    """The leaves of `tree` in `jax.tree.leaves` order."""
    return [leaf for _, leaf in leaves_with_paths(tree)]


def _format_path(path: Path) -> str:
    return "".join(f"[{key!r}]" for key in path) or "<root>"


def assert_same_structure(tree: Any, specs: Any, tree_name: str, specs_name: str) -> list[Any]:
    """The leaves of `tree`, after checking it is shaped like `specs` (as the reference does)."""
    tree_leaves = leaves_with_paths(tree)
    spec_paths = [path for path, _ in leaves_with_paths(specs)]
    paths = [path for path, _ in tree_leaves]
    if paths != spec_paths:
        missing = [_format_path(p) for p in spec_paths if p not in paths]
        extra = [_format_path(p) for p in paths if p not in spec_paths]
        raise ValueError(
            f"Pytree structures of {tree_name} and {specs_name} do not match: "
            f"{tree_name} lacks {missing or 'nothing'} and has extra {extra or 'nothing'}"
            f"{'' if missing or extra else ' (same leaves in a different order)'}. Give "
            f"{tree_name} the same containers and keys as {specs_name}."
        )
    return [leaf for _, leaf in tree_leaves]


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` rebuilt with `fn` applied to every leaf (containers keep their type)."""
    if tree is None:
        return None
    children = _children(tree)
    if children is None:
        return fn(tree)
    if isinstance(tree, Mapping):
        mapped = {key: map_leaves(fn, child) for key, child in children}
        if type(tree) is dict:
            return mapped
        try:  # OrderedDict, FrozenDict and other mappings built from a dict keep their type
            return cast(Any, type(tree))(mapped)
        except TypeError:
            return mapped
    values = [map_leaves(fn, child) for _, child in children]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*values)
    return type(tree)(values)
