"""A jax-tpu-embedding 0.2.0 training program, ported by one substitution.

Everything below the imports is written the way a user of the reference's current
release writes it; porting replaced `jax_tpu_embedding.sparsecore` with
`tilecore.compat` in the import lines and nothing else. It uses:

- feature specs in a `flax.core.FrozenDict` (what the reference's example configs
  return), auto-stacked and prepared for training;
- feedback-directed optimisation: statistics of a few batches recorded by the
  `NPZFileFDOClient`, published to files, loaded back and applied with
  `update_preprocessing_parameters`;
- the nnx `SparseCoreEmbed` layer and `PartitionedOptimizer` under `nnx.jit`,
  with the in-shardings `get_named_sharding` gives;
- Orbax checkpoints through the nnx `checkpoint_utils`: the run saves half-way,
  a fresh model restores that step, and training carries on from it.

It runs on whatever devices JAX sees; on a CPU, simulate several with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`.

    python examples/port_from_reference.py --tiny
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from flax.core import FrozenDict

# ---- The only lines that change. The reference program imports them from
# jax_tpu_embedding.sparsecore.lib.fdo, …lib.flax.nnx, …lib.nn and …utils.
from tilecore.compat.lib.fdo import file_fdo_client
from tilecore.compat.lib.flax.nnx import checkpoint_utils, embed
from tilecore.compat.lib.nn import embedding, embedding_spec
from tilecore.compat.utils import utils

# ---- Unchanged from here on.
EMBEDDING_DIM = 8


def build_feature_specs(batch: int, vocab: int) -> FrozenDict:
    """Two tables (their combiners differ, so each is its own stack), three features;
    query and history share the item table."""
    init = jax.nn.initializers.truncated_normal(stddev=0.1)
    user_table = embedding_spec.TableSpec(
        vocabulary_size=vocab, embedding_dim=EMBEDDING_DIM, initializer=init,
        optimizer=embedding_spec.AdagradOptimizerSpec(learning_rate=0.5),
        combiner="sum", name="user_table")
    item_table = embedding_spec.TableSpec(
        vocabulary_size=4 * vocab, embedding_dim=EMBEDDING_DIM, initializer=init,
        optimizer=embedding_spec.AdagradOptimizerSpec(learning_rate=0.5),
        combiner="mean", name="item_table")
    return FrozenDict({
        "user": embedding_spec.FeatureSpec(
            name="user", table_spec=user_table, input_shape=[batch, 1],
            output_shape=[batch, EMBEDDING_DIM]),
        "query": embedding_spec.FeatureSpec(
            name="query", table_spec=item_table, input_shape=[batch, 4],
            output_shape=[batch, EMBEDDING_DIM]),
        "history": embedding_spec.FeatureSpec(
            name="history", table_spec=item_table, input_shape=[batch, 4],
            output_shape=[batch, EMBEDDING_DIM]),
    })


def make_batch(rng: np.random.Generator, batch: int, vocab: int) -> tuple[dict, np.ndarray]:
    """Dense user and query IDs, ragged history (an object array of per-sample ID arrays)."""
    user = rng.integers(0, vocab, size=(batch, 1)).astype(np.int32)
    history = np.empty(batch, dtype=object)
    for i in range(batch):
        history[i] = rng.integers(0, 4 * vocab, size=rng.integers(1, 5)).astype(np.int32)
    features = {"user": user, "query": rng.integers(0, 4 * vocab, size=(batch, 4)).astype(
        np.int32), "history": history}
    labels = (user[:, 0] % 2).astype(np.float32)  # learnable from the user embedding
    return features, labels


class Model(nnx.Module):
    """SparseCore embeddings of the three features and a two-layer head."""

    def __init__(self, feature_specs: FrozenDict, mesh: jax.sharding.Mesh, seed: int) -> None:
        rngs = nnx.Rngs(seed)
        self.embedding_layer = embed.SparseCoreEmbed(feature_specs, "device", mesh, rngs)
        self.hidden = nnx.Linear(2 * EMBEDDING_DIM, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, inputs: embedding.PreprocessedInput, step: jax.Array) -> jax.Array:
        activations = self.embedding_layer(inputs, step)
        x = jnp.concatenate(
            [activations["user"], activations["query"] * activations["history"]], axis=-1)
        return self.out(nnx.relu(self.hidden(x)))[:, 0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024, help="global batch size")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where FDO statistics and checkpoints go (default: a temporary "
                             "directory)")
    parser.add_argument("--tiny", action="store_true", help="batch 64, vocab 32, 10 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.vocab, args.steps = 64, 32, 10
    with tempfile.TemporaryDirectory() as scratch:
        train(args, args.workdir or Path(scratch))


def train(args: argparse.Namespace, workdir: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), axis_names=("device",))
    num_sc_per_device = utils.num_sparsecores_per_device(mesh.devices.item(0))
    feature_specs = build_feature_specs(args.batch, args.vocab)
    embedding.auto_stack_tables(feature_specs, global_device_count=mesh.size,
                                num_sc_per_device=num_sc_per_device)
    embedding.prepare_feature_specs_for_training(feature_specs, global_device_count=mesh.size,
                                                 num_sc_per_device=num_sc_per_device)
    stacks = sorted(embedding.get_stacked_table_specs(feature_specs))
    print(f"{mesh.size} device(s) x {num_sc_per_device} SparseCores; stacks {stacks}")

    def preprocess(features: dict, step: int, **kwargs: Any) -> tuple[Any, Any]:
        return embedding.preprocess_sparse_dense_matmul_input(
            features, None, feature_specs, local_device_count=mesh.local_mesh.size,
            global_device_count=mesh.size, num_sc_per_device=num_sc_per_device,
            batch_number=step, **kwargs)

    rng = np.random.default_rng(0)
    batches = [make_batch(rng, args.batch, args.vocab) for _ in range(args.steps)]

    # FDO: record what a few batches need, publish it, load it back, apply it. The
    # default limits may be exceeded, so this pass drops IDs (and warns).
    fdo_client = file_fdo_client.NPZFileFDOClient(workdir / "fdo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, (features, _) in enumerate(batches[:4]):
            fdo_client.record(preprocess(features, step, allow_id_dropping=True)[1])
    fdo_client.publish()
    embedding.update_preprocessing_parameters(feature_specs, fdo_client.load(),
                                              num_sc_per_device)
    limits = {name: s.max_ids_per_partition
              for name, s in embedding.get_stacked_table_specs(feature_specs).items()}
    print(f"max_ids_per_partition after FDO: {limits}")

    model = Model(feature_specs, mesh, seed=0)
    optimizer = embed.PartitionedOptimizer(model, optax.adam(0.05))

    @nnx.jit(in_shardings=(embed.get_named_sharding(model, mesh),
                           embed.get_named_sharding(optimizer, mesh), None, None, None))
    def train_step(model: Model, optimizer: embed.PartitionedOptimizer,
                   inputs: embedding.PreprocessedInput, labels: jax.Array,
                   step: jax.Array) -> jax.Array:
        def loss_fn(model: Model) -> jax.Array:
            logits = model(inputs, step)
            return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    manager = checkpoint_utils.create_checkpoint_manager(
        cp_path=workdir / "checkpoints", cp_options=ocp.CheckpointManagerOptions())
    half = args.steps // 2
    losses = []
    for step, (features, labels) in enumerate(batches):
        if step == half:  # save, then carry on in a fresh model restored from the checkpoint
            checkpoint_utils.save_checkpoint(
                cp_manager=manager, step=step, model=model, optimizer=optimizer,
                feature_specs=feature_specs, num_global_devices=mesh.size,
                num_sc_per_device=num_sc_per_device)
            manager.wait_until_finished()
            model = Model(feature_specs, mesh, seed=1)
            optimizer = embed.PartitionedOptimizer(model, optax.adam(0.05))
            checkpoint_utils.restore_checkpoint(cp_manager=manager, step=step, model=model,
                                                optimizer=optimizer)
            print(f"step {step}: saved, and restored into a fresh model")
        inputs, _ = preprocess(features, step)
        labels = jax.device_put(labels, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec("device")))
        losses.append(float(train_step(model, optimizer, inputs, labels, jnp.int32(step))))
        print(f"step {step}: loss {losses[-1]:.5f}")
    manager.close()
    if not losses[-1] < losses[0]:
        raise SystemExit(f"port_from_reference: loss did not go down: {losses}")
    print(f"port_from_reference: OK (loss {losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
