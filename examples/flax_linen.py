"""A DLRM-style Flax linen model: `tilecore.layers.LinenEmbed` plus an MLP, one jitted step.

The embedding layer keeps its stacked tables and optimizer slots in the
`"embeddings"` collection, apart from the dense `"params"`; its activations carry
an all-zero probe (the `"probes"` collection) whose gradient is exactly the
activation gradient. So one jitted train step

1. differentiates the loss with respect to `params` and `probes` at once,
2. updates `params` with optax (Adam), and
3. hands the probe gradients to `tilecore.layers.update_embeddings`, which applies
   each table's own optimizer (Adagrad here) to the rows the batch touched;

no gradient as large as a table is ever formed. The model is DLRM's shape: a
bottom MLP over dense features, pairwise dot products between it and the
embeddings, a top MLP over those. Labels come from a hidden per-ID score plus a
hidden linear function of the dense features, so the model can learn them.

Checks: the loss goes down, and rows that no batch touched are bit for bit their
initial values (the update is sparse).

    python examples/flax_linen.py            # batch 1024, 16 batches, 4 epochs
    python examples/flax_linen.py --tiny     # seconds, as the test suite runs it
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import tilecore as tc
from tilecore import layers, ops

DIM = 8  # every table's embedding_dim: the interaction takes dot products between them
DENSE_FEATURES = 4


class DLRM(nn.Module):
    """Bottom MLP over dense features, embeddings, pairwise dots, top MLP → one logit."""

    plan: tc.StackingPlan
    hidden: int = 32

    @nn.compact
    def __call__(self, batch: tc.PreprocessedBatch, dense: jax.Array) -> jax.Array:
        acts = layers.LinenEmbed(self.plan, name="embed")(batch)  # {feature: [batch, DIM]}
        bottom = nn.relu(nn.Dense(DIM, name="bottom")(dense))
        vectors = jnp.stack([bottom, *(acts[name] for name in sorted(acts))], axis=1)
        dots = jnp.einsum("bfd,bgd->bfg", vectors, vectors)
        upper_i, upper_j = np.triu_indices(vectors.shape[1], k=1)  # each pair once
        x = jnp.concatenate([bottom, dots[:, upper_i, upper_j]], axis=-1)
        hidden = nn.relu(nn.Dense(self.hidden, name="top_hidden")(x))
        return nn.Dense(1, name="top_out")(hidden)[:, 0]


def feature_specs(batch: int, vocab: int) -> list[tc.FeatureSpec]:
    """A user table (one ID per sample) and an item table serving two features."""
    users = tc.TableSpec(name="users", vocab_size=vocab // 4, embedding_dim=DIM,
                         optimizer=tc.Adagrad(learning_rate=0.1))
    items = tc.TableSpec(name="items", vocab_size=vocab, embedding_dim=DIM, combiner="mean",
                         optimizer=tc.Adagrad(learning_rate=0.1))
    return [tc.FeatureSpec(name="user", table=users, input_shape=(batch, 1)),
            tc.FeatureSpec(name="clicked", table=items, input_shape=(batch, 4)),
            tc.FeatureSpec(name="viewed", table=items, input_shape=(batch, 8))]


def make_data(features: list[tc.FeatureSpec], count: int, seed: int = 0
              ) -> list[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]]:
    """`count` batches of (IDs per feature, dense features, 0/1 labels)."""
    rng = np.random.default_rng(seed)
    score = {f.table.name: rng.normal(size=f.table.vocab_size) for f in features}
    weights = rng.normal(size=DENSE_FEATURES)
    batch = features[0].input_shape[0]
    out = []
    for _ in range(count):
        ids = {f.name: rng.integers(0, f.table.vocab_size, f.input_shape) for f in features}
        dense = rng.normal(size=(batch, DENSE_FEATURES)).astype(np.float32)
        logit = dense @ weights + sum(score[f.table.name][ids[f.name]].mean(1) for f in features)
        out.append((ids, dense, (logit > 0).astype(np.float32)))
    return out


def touched_rows(plan: tc.StackingPlan, data: list[Any]) -> dict[str, np.ndarray]:
    """Table name → bool `[vocab]`: whether any batch looks the row up."""
    seen = {name: np.zeros(t.vocab_size, bool) for name, t in plan.tables.items()}
    for ids, _, _ in data:
        for name, feature in plan.features.items():
            seen[feature.table.name][ids[name].ravel()] = True
    return seen


def tables_of(plan: tc.StackingPlan, variables: Any) -> dict[str, np.ndarray]:
    """Per-table `[vocab, dim]` numpy values of the model's embedding tables."""
    stacks = layers.embedding_variables(variables, "embed")  # the LinenEmbed named "embed"
    return ops.unshard(plan, {name: v.table for name, v in stacks.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=20_000, help="rows of the item table")
    parser.add_argument("--batches", type=int, default=16, help="distinct batches per epoch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="batch 64, vocab 2000, 4x8 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.vocab, args.batches, args.epochs = 64, 2000, 4, 8

    features = feature_specs(args.batch, args.vocab)
    data = make_data(features, args.batches)
    # Limits (IDs per partition, buffer sizes) under which every batch fits, by observation.
    plan, _ = tc.tune_limits(
        tc.plan_stacking(features, tc.Topology(global_devices=1, sc_per_device=4)),
        [ids for ids, _, _ in data])
    model = DLRM(plan)
    # Host preprocessing (numpy + numba), outside jit; the layer knows its plan.
    embed = layers.LinenEmbed(plan)
    batches = [(embed.preprocess(ids)[0], jnp.asarray(dense), jnp.asarray(labels))
               for ids, dense, labels in data]

    variables = model.init(jax.random.key(0), *batches[0][:2])
    print("collections:", sorted(variables), "| dense params:",
          sum(x.size for x in jax.tree.leaves(variables["params"])))
    initial = tables_of(plan, variables)
    tx = optax.adam(3e-3)
    opt_state = tx.init(variables["params"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(variables: dict[str, Any], opt_state: Any, batch: tc.PreprocessedBatch,
                   dense: jax.Array, labels: jax.Array, step: jax.Array
                   ) -> tuple[dict[str, Any], Any, jax.Array]:
        def loss_fn(params: Any, probes: Any) -> jax.Array:
            logits = model.apply({**variables, "params": params, "probes": probes}, batch,
                                 dense)
            return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

        loss, (grads, activation_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            variables["params"], variables["probes"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        embeddings = layers.update_embeddings(model, variables, activation_grads, step,
                                              batch, dense)
        params = optax.apply_updates(variables["params"], updates)
        return {**variables, "params": params, "embeddings": embeddings}, opt_state, loss

    epoch_losses = []
    for epoch in range(args.epochs):
        losses = []
        for i, (batch, dense, labels) in enumerate(batches):
            step = jnp.int32(epoch * len(batches) + i)
            variables, opt_state, loss = train_step(variables, opt_state, batch, dense, labels,
                                                    step)
            losses.append(float(loss))
        epoch_losses.append(float(np.mean(losses)))
        print(f"epoch {epoch}: mean loss {epoch_losses[-1]:.5f}")

    final = tables_of(plan, variables)
    for name, seen in touched_rows(plan, data).items():
        if not np.array_equal(final[name][~seen], initial[name][~seen]):
            raise SystemExit(f"flax_linen: table {name!r} changed rows no batch touched.")
        if np.array_equal(final[name][seen], initial[name][seen]):
            raise SystemExit(f"flax_linen: table {name!r} was not trained.")
        print(f"table {name}: {int(seen.sum())} of {len(seen)} rows trained, the rest unchanged")
    if not epoch_losses[-1] < epoch_losses[0]:
        raise SystemExit(f"flax_linen: loss did not go down: {epoch_losses}")
    print(f"flax_linen: OK (loss {epoch_losses[0]:.4f} -> {epoch_losses[-1]:.4f})")


if __name__ == "__main__":
    main()
