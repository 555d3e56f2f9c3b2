"""A table trained with your own update rule (`tilecore.CustomOptimizer`).

The rule is a pure `jnp` function of the touched rows:
`update_fn(grad, row, *slots, *hyperparameters) -> (new_row, *new_slots)`, each
array `[rows, padded_dim]` float32. Here: heavy-ball momentum on gradients whose
per-row norm is clipped,

    ĝ = g · min(1, clip / ‖g‖)      v' = μ·v + ĝ      w' = w − lr·v'

with one slot (the velocity, starting at 0) and hyperparameters
`(learning_rate, μ, clip)`. The fused sparse update applies it to the rows a
batch touched, exactly once per row (duplicate IDs summed first).

The script checks one `ops.lookup_grad` step against a plain numpy version of
the same rule on random data, then trains a few steps and prints the loss.

    python examples/custom_optimizer.py --tiny
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import tilecore as tc
from tilecore import ops

MOMENTUM, CLIP = 0.9, 1.0


def clipped_momentum(grad: jax.Array, row: jax.Array, velocity: jax.Array,
                     lr: jax.Array, momentum: jax.Array, clip: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """The device rule: norm-clipped heavy-ball momentum, one row per line."""
    norm = jnp.sqrt(jnp.sum(grad * grad, axis=-1, keepdims=True))
    clipped = grad * jnp.minimum(1.0, clip / jnp.maximum(norm, 1e-12))
    velocity = momentum * velocity + clipped
    return row - lr * velocity, velocity


def numpy_step(table: np.ndarray, ids: np.ndarray, act_grads: np.ndarray, lr: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """The same rule in numpy on a `[vocab, dim]` table, from the raw `[batch, k]` IDs
    (sum combiner, unit weights): per row `g = Σ act_grad[sample]` over its
    occurrences, then the update on touched rows only."""
    grads = np.zeros_like(table, dtype=np.float64)
    np.add.at(grads, ids, act_grads[:, None, :])
    touched = np.unique(ids)
    new_table = table.astype(np.float64).copy()
    velocity = np.zeros_like(new_table)
    g = grads[touched]
    norm = np.linalg.norm(g, axis=-1, keepdims=True)
    velocity[touched] = g * np.minimum(1.0, CLIP / np.maximum(norm, 1e-12))  # μ·0 + ĝ
    new_table[touched] -= lr * velocity[touched]
    return new_table, velocity


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--ids", type=int, default=4, help="IDs per sample")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="batch 32, vocab 200, 5 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.vocab, args.steps = 32, 200, 5
    lr, dim = 0.3, 8

    optimizer = tc.CustomOptimizer(
        update_fn=clipped_momentum, learning_rate=lr, slot_initial_value_tuple=(0.0,),
        extra_hyperparameters=(MOMENTUM, CLIP), name="clipped_momentum")
    table = tc.TableSpec(name="words", vocab_size=args.vocab, embedding_dim=dim,
                         optimizer=optimizer, combiner="sum")
    feature = tc.FeatureSpec(name="text", table=table, input_shape=(args.batch, args.ids))
    plan = tc.plan_stacking([feature], tc.Topology(global_devices=1, sc_per_device=4))
    stack = plan.table_settings["words"].stack_name

    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, size=(args.batch, args.ids))
    batch, _ = tc.preprocess(plan, {"text": ids})
    variables = ops.init_tables(plan, jax.random.key(0))

    # One step against numpy, on random activation gradients.
    act_grads = rng.normal(size=(args.batch, dim)).astype(np.float32)
    before = ops.unshard(plan, {stack: variables[stack].table})["words"]
    updated = ops.lookup_grad(plan, batch, variables, {"text": jnp.asarray(act_grads)}, 0)
    got_table = ops.unshard(plan, {stack: updated[stack].table})["words"]
    got_velocity = ops.unshard(plan, {stack: updated[stack].slots[0]})["words"]
    want_table, want_velocity = numpy_step(before, ids, act_grads, lr)
    np.testing.assert_allclose(got_table, want_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_velocity, want_velocity, rtol=1e-5, atol=1e-6)
    error = float(np.abs(got_table - want_table).max())
    print(f"one step matches numpy: {len(np.unique(ids))} rows touched, "
          f"max |device - numpy| = {error:.2e}")

    # Training: pull each sample's pooled embedding towards a fixed random target.
    targets = jnp.asarray(rng.normal(size=(args.batch, dim)), jnp.float32)

    def loss_fn(params: None, acts: dict[str, jax.Array]) -> jax.Array:
        del params  # no dense model: the embeddings alone fit the targets
        return jnp.mean(jnp.sum((acts["text"] - targets) ** 2, axis=-1))

    step_fn = jax.jit(lambda b, v, s: ops.training_update(plan, b, v, loss_fn, None, s),
                      donate_argnums=1)
    losses = []
    for step in range(args.steps):
        loss, _, variables = step_fn(batch, variables, jnp.int32(step))
        losses.append(float(loss))
        print(f"step {step}: loss {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"custom_optimizer: loss did not go down: {losses}")
    print(f"custom_optimizer: OK (loss {losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
