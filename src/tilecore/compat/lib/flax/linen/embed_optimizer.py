"""The reference's optimizer helpers for linen models with a `SparseCoreEmbed`.

`create_optimizer_for_sc_model(params, tc_optimizer)` is an optax
`multi_transform`: the dense parameters get `tc_optimizer`, the embedding
parameters (`sc_embedding_variables`) an identity, because their "gradients" are
already the updated variables; `apply_updates_for_sc_model` adds the dense
updates and *replaces* the embedding parameters with theirs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from .embed import EMBEDDING_PARAM_NAME


def _is_embedding(path: tuple[Any, ...]) -> bool:
    return any(isinstance(key, jax.tree_util.DictKey) and key.key == EMBEDDING_PARAM_NAME
               for key in path)


def create_optimizer_for_sc_model(params: Any, tc_optimizer: optax.GradientTransformation
                                  ) -> optax.GradientTransformation:
    """`tc_optimizer` for dense parameters; the embedding "updates" pass through unchanged."""
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "sc_optimizer" if _is_embedding(path) else "tc_optimizer", params)
    return optax.multi_transform(
        {"tc_optimizer": tc_optimizer, "sc_optimizer": optax.identity()}, labels)


def apply_updates_for_sc_model(params: Any, updates: Any) -> Any:
    """Dense parameters `+ update`; embedding parameters replaced by their update."""

    def apply(path: tuple[Any, ...], param: Any, update: Any) -> Any:
        if _is_embedding(path):
            return update
        return jnp.asarray(param + update).astype(jnp.asarray(update).dtype)

    return jax.tree_util.tree_map_with_path(apply, params, updates)
