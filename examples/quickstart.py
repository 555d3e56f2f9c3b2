"""Quickstart: the README's usage as a runnable script.

specs → stacking plan → host preprocessing → lookup → fused training update.

One table (`items`) serves two features: a single clicked item and a ragged
history of up to `--history` items. A tiny dense model (one weight per embedding
column of the click·history product, plus a bias) learns to predict a synthetic
label; the embedding rows touched by each batch are updated by the table's own
optimizer (Adagrad) inside `ops.training_update`, the dense weights by plain SGD.

    python examples/quickstart.py            # batch 1024, vocab 100 000
    python examples/quickstart.py --tiny     # seconds, as the test suite runs it
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import tilecore as tc
from tilecore import ops


def make_inputs(batch: int, vocab: int, history: int, seed: int) -> dict[str, object]:
    """A dense `[batch, 1]` feature and a ragged one (sample i: 1..history IDs)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, history + 1, size=batch)
    return {
        "clicked": rng.integers(0, vocab, size=(batch, 1)),
        "history": tc.Ragged(values=rng.integers(0, vocab, size=lengths.sum()),
                             row_splits=np.concatenate([[0], np.cumsum(lengths)])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--history", type=int, default=50, help="most IDs per history row")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="batch 64, vocab 1000, 8 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.vocab, args.history, args.steps = 64, 1000, 8, 8

    # 1. Specs are frozen values; 2. the plan says where every table and feature goes.
    items = tc.TableSpec(name="items", vocab_size=args.vocab, embedding_dim=16,
                         combiner="mean", optimizer=tc.Adagrad(learning_rate=0.5))
    features = [
        tc.FeatureSpec(name="clicked", table=items, input_shape=(args.batch, 1)),
        tc.FeatureSpec(name="history", table=items, input_shape=(args.batch, args.history)),
    ]
    plan = tc.plan_stacking(features, tc.Topology(global_devices=1, sc_per_device=4))

    # 3. Host preprocessing (numpy + numba, no JAX): packed buffers and statistics.
    inputs = make_inputs(args.batch, args.vocab, args.history, seed=0)
    try:
        batch, stats = tc.preprocess(plan, inputs)
    except tc.LimitExceededError as error:  # limits too small: adopt the observed ones
        plan = tc.update_preprocessing_parameters(plan, error.stats)
        batch, stats = tc.preprocess(plan, inputs)
    print(f"plan: stacks {sorted(plan.stacks)}; max IDs per partition "
          f"{int(stats.max_ids_per_partition['items'].max())}, "
          f"COO buffer {batch.stacks['items'].embedding_ids.shape}")

    # 4. Device: tables (+ Adagrad accumulator) in the stacked, sharded layout; lookup.
    variables = ops.init_tables(plan, jax.random.key(0))
    activations = jax.jit(lambda b, v: ops.lookup(plan, b, v))(batch, variables)
    print("lookup:", {name: a.shape for name, a in activations.items()})

    # 5. Train: a synthetic label the embeddings must learn, the dense model's loss.
    labels = jnp.asarray(np.random.default_rng(1).integers(0, 2, args.batch), jnp.float32)

    def loss_fn(params: dict[str, jax.Array], acts: dict[str, jax.Array]) -> jax.Array:
        logits = (acts["clicked"] * acts["history"]) @ params["w"] + params["b"]
        return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)  # logistic loss

    @jax.jit
    def train_step(batch: tc.PreprocessedBatch, variables: dict, params: dict, step: jax.Array
                   ) -> tuple[jax.Array, dict, dict]:
        loss, grads, variables = ops.training_update(plan, batch, variables, loss_fn, params,
                                                     step)
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
        return loss, variables, params

    params = {"w": jnp.ones((16,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    losses = []
    for step in range(args.steps):
        loss, variables, params = train_step(batch, variables, params, jnp.int32(step))
        losses.append(float(loss))
        print(f"step {step}: loss {losses[-1]:.5f}")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"quickstart: loss did not go down: {losses}")
    print(f"quickstart: OK (loss {losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
