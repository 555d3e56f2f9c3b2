"""A jax-tpu-embedding training script, ported to tilecore by changing its imports.

Everything below the imports is written the way a user of the reference system
(`jax_tpu_embedding.sparsecore.lib.nn`) writes it: mutable `FeatureSpec` /
`TableSpec`, `auto_stack_tables` and `prepare_feature_specs_for_training` filling
in the stacking, `preprocess_sparse_dense_matmul_input` on the host,
`init_embedding_variables` on a `NamedSharding`, and the per-device
`tpu_sparse_dense_matmul` / `tpu_sparse_dense_matmul_grad` inside `shard_map`
over the mesh, around a small optax dense model. It runs on whatever devices JAX
sees; on a CPU, simulate several with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`.

    python examples/port_from_reference.py --tiny
"""

from __future__ import annotations

import argparse
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# ---- The only lines that change. The reference script imports:
# from jax_tpu_embedding.sparsecore.lib.nn import embedding
# from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec
from tilecore.compat import embedding, embedding_spec

# ---- Unchanged from here on.
NUM_SC_PER_DEVICE = 2
EMBEDDING_DIM = 8


def build_feature_specs(batch: int, vocab: int) -> dict[str, embedding_spec.FeatureSpec]:
    """Two tables of the same width (auto-stacked together), three features."""
    init = jax.nn.initializers.truncated_normal(stddev=0.1)
    user_table = embedding_spec.TableSpec(
        vocabulary_size=vocab, embedding_dim=EMBEDDING_DIM, initializer=init,
        optimizer=embedding_spec.AdagradOptimizerSpec(learning_rate=0.5),
        combiner="sum", name="user_table")
    item_table = embedding_spec.TableSpec(
        vocabulary_size=4 * vocab, embedding_dim=EMBEDDING_DIM, initializer=init,
        optimizer=embedding_spec.AdagradOptimizerSpec(learning_rate=0.5),
        combiner="mean", name="item_table")
    return {
        "user": embedding_spec.FeatureSpec(
            name="user", table_spec=user_table, input_shape=[batch, 1],
            output_shape=[batch, EMBEDDING_DIM]),
        "query": embedding_spec.FeatureSpec(
            name="query", table_spec=item_table, input_shape=[batch, 4],
            output_shape=[batch, EMBEDDING_DIM]),
        "history": embedding_spec.FeatureSpec(
            name="history", table_spec=item_table, input_shape=[batch, 4],
            output_shape=[batch, EMBEDDING_DIM]),
    }


def make_batch(rng: np.random.Generator, batch: int, vocab: int) -> tuple[dict, np.ndarray]:
    """Dense user and query IDs, ragged history (1-D object array of ID arrays)."""
    user = rng.integers(0, vocab, size=(batch, 1)).astype(np.int32)
    history = np.empty(batch, dtype=object)
    for i in range(batch):
        history[i] = rng.integers(0, 4 * vocab, size=rng.integers(1, 5)).astype(np.int32)
    features = {"user": user, "query": rng.integers(0, 4 * vocab, size=(batch, 4)).astype(
        np.int32), "history": history}
    labels = (user[:, 0] % 2).astype(np.float32)  # learnable from the user embedding
    return features, labels


def max_stats(stats: list[embedding.SparseDenseMatmulInputStats]
              ) -> embedding.SparseDenseMatmulInputStats:
    """Element-wise maximum over batches (what an FDO client's `load()` returns)."""
    fields = ("max_ids_per_partition", "max_unique_ids_per_partition",
              "required_buffer_size_per_sc")
    return embedding.SparseDenseMatmulInputStats(**{
        field: {name: np.max([getattr(s, field)[name] for s in stats], axis=0)
                for name in getattr(stats[0], field)}
        for field in fields})


def dense_loss(activations: dict[str, jax.Array], params: dict[str, jax.Array],
               labels: jax.Array) -> jax.Array:
    x = jnp.concatenate([activations["user"], activations["query"] * activations["history"]],
                        axis=-1)
    logits = jax.nn.relu(x @ params["w1"]) @ params["w2"]
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024, help="global batch size")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="batch 64, vocab 32, 8 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.vocab, args.steps = 64, 32, 8

    mesh = Mesh(np.array(jax.devices()), axis_names=("device",))
    num_devices = mesh.size
    feature_specs = build_feature_specs(args.batch, args.vocab)
    embedding.auto_stack_tables(feature_specs, global_device_count=num_devices,
                                num_sc_per_device=NUM_SC_PER_DEVICE)
    embedding.prepare_feature_specs_for_training(feature_specs, global_device_count=num_devices,
                                                 num_sc_per_device=NUM_SC_PER_DEVICE)
    stacks = sorted(embedding.get_stacked_table_specs(feature_specs))
    print(f"{num_devices} device(s) x {NUM_SC_PER_DEVICE} SparseCores; stacks {stacks}")

    emb_variables = embedding.init_embedding_variables(
        jax.random.key(0), embedding.get_table_specs(feature_specs),
        NamedSharding(mesh, P("device", None)), NUM_SC_PER_DEVICE)
    k1, k2 = jax.random.split(jax.random.key(1))
    params = {"w1": 0.3 * jax.random.normal(k1, (2 * EMBEDDING_DIM, 16)),
              "w2": 0.3 * jax.random.normal(k2, (16,))}
    tx = optax.adam(0.05)
    opt_state = tx.init(params)

    # Per-device forward and backward (the backward applies the tables' optimizers).
    sparse_matmul = jax.shard_map(
        functools.partial(embedding.tpu_sparse_dense_matmul, feature_specs=feature_specs,
                          global_device_count=num_devices, num_sc_per_device=NUM_SC_PER_DEVICE),
        mesh=mesh, in_specs=(P("device"), P("device")), out_specs=P("device"), check_vma=False)
    sparse_matmul_grad = jax.shard_map(
        lambda grads, inputs, variables, step: embedding.tpu_sparse_dense_matmul_grad(
            grads, inputs, variables, feature_specs, global_device_count=num_devices,
            num_sc_per_device=NUM_SC_PER_DEVICE, step=step),
        mesh=mesh, in_specs=(P("device"), P("device"), P("device"), P()),
        out_specs=P("device"), check_vma=False)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def train_step(inputs: Any, emb_variables: Any, params: Any, opt_state: Any,
                   labels: jax.Array, step: jax.Array) -> tuple[Any, ...]:
        activations = sparse_matmul(inputs, emb_variables)
        loss, (activation_grads, param_grads) = jax.value_and_grad(dense_loss, argnums=(0, 1))(
            activations, params, labels)
        emb_variables = sparse_matmul_grad(activation_grads, inputs, emb_variables, step)
        updates, opt_state = tx.update(param_grads, opt_state, params)
        return loss, emb_variables, optax.apply_updates(params, updates), opt_state

    preprocess = functools.partial(
        embedding.preprocess_sparse_dense_matmul_input, features_weights=None,
        feature_specs=feature_specs, local_device_count=jax.local_device_count(),
        global_device_count=num_devices, num_sc_per_device=NUM_SC_PER_DEVICE)
    rng = np.random.default_rng(0)
    batches = [make_batch(rng, args.batch, args.vocab) for _ in range(args.steps)]
    # Limits from the batches' statistics (one pass of the FDO loop); the default 256
    # IDs per partition may be exceeded, so this pass drops IDs, silently.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = [preprocess(features, allow_id_dropping=True)[1] for features, _ in batches]
    embedding.update_preprocessing_parameters(feature_specs, max_stats(observed),
                                              NUM_SC_PER_DEVICE)
    limits = {name: s.max_ids_per_partition
              for name, s in embedding.get_stacked_table_specs(feature_specs).items()}
    print(f"max_ids_per_partition after calibration: {limits}")

    losses = []
    for step, (features, labels) in enumerate(batches):
        preprocessed, _ = preprocess(features)
        labels = jax.device_put(labels, NamedSharding(mesh, P("device")))
        loss, emb_variables, params, opt_state = train_step(
            preprocessed, emb_variables, params, opt_state, labels, jnp.int32(step))
        losses.append(float(loss))
        print(f"step {step}: loss {losses[-1]:.5f}")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"port_from_reference: loss did not go down: {losses}")
    print(f"port_from_reference: OK (loss {losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
