"""Reading a linen model's embedding tables out of its variables (to export, check or save)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..ops import EmbeddingVariables
from ._linen import EMBEDDINGS, TABLES


def embedding_variables(variables: Mapping[str, Any], *path: str
                        ) -> dict[str, EmbeddingVariables]:
    """The `{stack: EmbeddingVariables}` of the `LinenEmbed` at module `path` in `variables`.

    `variables` is what `model.init` returns (or a later state with the same
    collections); `path` names the modules from the root down to the layer, e.g.
    `embedding_variables(variables, "embed")`. With no `path`, the model must hold
    exactly one `LinenEmbed`, wherever it is. `tilecore.ops.unshard(plan, {s:
    v.table ...})` turns the result into per-table `[vocab, dim]` arrays.

    Raises:
      KeyError: `variables` has no `"embeddings"` collection, or no layer at
        `path`, or (without `path`) none or several layers; names the paths found.
    """
    if EMBEDDINGS not in variables:
        raise KeyError(f"embedding_variables: no {EMBEDDINGS!r} collection in the variables "
                       f"(they hold {sorted(variables)}); pass what model.init returned.")
    found = dict(_layers(variables[EMBEDDINGS], ()))
    if path:
        if path not in found:
            raise KeyError(f"embedding_variables: no LinenEmbed at {'/'.join(path)!r}; the "
                           f"model has them at {_names(found)}.")
        return found[path]
    if len(found) != 1:
        raise KeyError(f"embedding_variables: the model has {len(found)} LinenEmbed layers "
                       f"({_names(found)}); name one by its module path.")
    return next(iter(found.values()))


def _layers(tree: Any, path: tuple[str, ...]) -> Any:
    """(module path, tables) of every layer in the `"embeddings"` collection's nesting."""
    if not isinstance(tree, Mapping):
        return
    for key, value in tree.items():
        if key == TABLES and isinstance(value, Mapping) and all(
                isinstance(v, EmbeddingVariables) for v in value.values()):
            yield path, dict(value)
        else:
            yield from _layers(value, (*path, str(key)))


def _names(found: Mapping[tuple[str, ...], Any]) -> list[str]:
    return sorted("/".join(p) or "(root)" for p in found)
