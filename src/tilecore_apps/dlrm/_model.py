"""The dense half of a DLRM-style click model: bottom MLP, pairwise dots, top MLP.

    bottom = MLP(dense)                         [B, d]   (d = embedding dim)
    z      = [bottom, emb_1, …, emb_F]          [B, F+1, d]
    dots   = ⟨z_i, z_j⟩ for i < j               [B, (F+1)F/2]
    logit  = MLP_top([bottom, dots])            [B]

The embeddings come from tilecore's lookup; the parameters here are a plain
pytree (trained with optax), so the functions are pure and jit-able.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

Params = dict[str, list[dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the dense model.

    Attributes:
      embedding_dim: width of every embedding (DLRM dots need one width).
      bottom: hidden widths of the bottom MLP (its output has `embedding_dim`).
      top: hidden widths of the top MLP (its output is one logit).
    """

    embedding_dim: int = 16
    bottom: tuple[int, ...] = (32,)
    top: tuple[int, ...] = (64, 32)


def _mlp(key: jax.Array, widths: Sequence[int]) -> list[dict[str, jax.Array]]:
    layers = []
    for k, (fan_in, fan_out) in zip(jax.random.split(key, len(widths) - 1),
                                    itertools.pairwise(widths), strict=True):
        scale = np.sqrt(2.0 / (fan_in + fan_out))  # Glorot normal
        layers.append({"w": scale * jax.random.normal(k, (fan_in, fan_out), jnp.float32),
                       "b": jnp.zeros((fan_out,), jnp.float32)})
    return layers


def init_params(key: jax.Array, config: ModelConfig, *, num_dense: int,
                num_features: int) -> Params:
    """Fresh parameters for `num_dense` dense inputs and `num_features` embeddings."""
    d = config.embedding_dim
    pairs = (num_features + 1) * num_features // 2
    bottom_key, top_key = jax.random.split(key)
    return {
        "bottom": _mlp(bottom_key, (num_dense, *config.bottom, d)),
        "top": _mlp(top_key, (d + pairs, *config.top, 1)),
    }


def _apply_mlp(layers: list[dict[str, jax.Array]], x: ArrayLike, *, last_relu: bool
               ) -> jax.Array:
    x = jnp.asarray(x)
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if i < len(layers) - 1 or last_relu:
            x = jax.nn.relu(x)
    return x


def logits(params: Params, embeddings: Sequence[jax.Array], dense: ArrayLike) -> jax.Array:
    """`[B]` logits from per-feature `[B, d]` embeddings and `[B, num_dense]` dense inputs."""
    bottom = _apply_mlp(params["bottom"], dense, last_relu=True)
    z = jnp.stack([bottom, *embeddings], axis=1)
    dots = jnp.einsum("bid,bjd->bij", z, z)
    i, j = np.triu_indices(z.shape[1], k=1)
    top_in = jnp.concatenate([bottom, dots[:, i, j]], axis=1)
    return _apply_mlp(params["top"], top_in, last_relu=False)[:, 0]


def bce_loss(logit: jax.Array, labels: ArrayLike) -> jax.Array:
    """Mean sigmoid binary cross-entropy."""
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, jnp.asarray(labels)))


def num_params(params: Any) -> int:
    """Scalars in a parameter pytree."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
