"""A jax-tpu-embedding 0.2.0 training program, ported by one substitution.

Everything below the imports is written the way a user of the reference's current
release writes it; porting replaced `jax_tpu_embedding.sparsecore` with
`tilecore.compat` in the import lines and nothing else. It uses:

- feature specs in a `flax.core.FrozenDict` (what the reference's example configs
  return), auto-stacked and prepared for training;
- feedback-directed optimisation: statistics of a few batches recorded by the
  `NPZFileFDOClient`, published to files, loaded back and applied with
  `update_preprocessing_parameters`;
- the nnx `SparseCoreEmbed` layer and `PartitionedOptimizer` in a plain train
  step over the model's nnx state, pipelined by `auto_pipelining` (the lookup of
  step i runs with the dense part of step i-1, one step stale);
- Orbax checkpoints through the nnx `checkpoint_utils`: the run saves half-way,
  a fresh model restores that step, and training carries on from it; at the end
  the last checkpoint is converted for one device, restored into a one-device
  model, and must give the same loss on a batch as the model that wrote it.

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
# jax_tpu_embedding.sparsecore.lib.auto_pipelining, …lib.fdo, …lib.flax.nnx, …lib.nn
# and …utils.
from tilecore.compat.lib.auto_pipelining import auto_pipelining
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


def preprocess(features: dict, step: int, feature_specs: FrozenDict, num_devices: int,
               num_sc_per_device: int, **kwargs: Any) -> tuple[Any, Any]:
    """This (only) process's batch for `num_devices` devices: (inputs, statistics)."""
    return embedding.preprocess_sparse_dense_matmul_input(
        features, None, feature_specs, local_device_count=num_devices,
        global_device_count=num_devices, num_sc_per_device=num_sc_per_device,
        batch_number=step, **kwargs)


def prepare_specs(batch: int, vocab: int, num_devices: int, num_sc_per_device: int,
                  fdo_dir: Path, batches: list[tuple[dict, np.ndarray]]) -> FrozenDict:
    """Feature specs stacked and prepared for `num_devices`, their limits tuned by FDO:
    what the batches need is recorded, published to files, loaded back and applied.
    The default limits may be exceeded, so those passes drop IDs (and warn)."""
    feature_specs = build_feature_specs(batch, vocab)
    embedding.auto_stack_tables(feature_specs, global_device_count=num_devices,
                                num_sc_per_device=num_sc_per_device)
    embedding.prepare_feature_specs_for_training(feature_specs, global_device_count=num_devices,
                                                 num_sc_per_device=num_sc_per_device)
    fdo_client = file_fdo_client.NPZFileFDOClient(fdo_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, (features, _) in enumerate(batches):
            _, stats = preprocess(features, step, feature_specs, num_devices,
                                  num_sc_per_device, allow_id_dropping=True)
            fdo_client.record(stats)
    fdo_client.publish()
    embedding.update_preprocessing_parameters(feature_specs, fdo_client.load(),
                                              num_sc_per_device)
    return feature_specs


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


def batch_loss(model: Model, feature_specs: FrozenDict, num_devices: int,
               num_sc_per_device: int, batch: tuple[dict, np.ndarray], step: int) -> float:
    """The model's loss on one batch (no update)."""
    features, labels = batch
    inputs, _ = preprocess(features, step, feature_specs, num_devices, num_sc_per_device)
    logits = nnx.jit(lambda model, inputs, step: model(inputs, step))(model, inputs,
                                                                      jnp.int32(step))
    return float(optax.sigmoid_binary_cross_entropy(logits, labels).mean())


def one_device_model(args: argparse.Namespace, workdir: Path, num_sc_per_device: int,
                     batches: list[tuple[dict, np.ndarray]]) -> tuple[Model, FrozenDict]:
    """The last checkpoint, converted offline for one device and restored into a model
    there (with specs tuned for one device)."""
    one_specs = prepare_specs(args.batch, args.vocab, 1, num_sc_per_device,
                              workdir / "fdo-one-device", batches)
    checkpoint_utils.convert_cross_topology_checkpoint(
        input_checkpoint_path=workdir / "checkpoints",
        output_checkpoint_path=workdir / "checkpoints-one-device",
        target_topology=checkpoint_utils.TargetTopology(
            num_global_devices=1, num_sc_per_device=num_sc_per_device),
        target_feature_specs=one_specs)
    one_mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), axis_names=("device",))
    one_model = Model(one_specs, one_mesh, seed=2)
    checkpoint_utils.restore_checkpoint(
        input_checkpoint_path=workdir / "checkpoints-one-device", model=one_model,
        optimizer=embed.PartitionedOptimizer(one_model, optax.adam(0.05)))
    return one_model, one_specs


def run_pipelined(model: Model, optimizer: embed.PartitionedOptimizer,
                  feature_specs: FrozenDict, mesh: jax.sharding.Mesh, num_sc_per_device: int,
                  batches: list[tuple[dict, np.ndarray]], first_step: int) -> list[float]:
    """Train on `batches` with the plain step pipelined by `auto_pipelining` (the
    lookup of step i overlaps the dense part of step i-1 and sees the embedding
    updates of steps <= i-2); the pipeline is drained at the end and `model` and
    `optimizer` hold the result. Returns the loss of every step."""
    graphdef, state = nnx.split((model, optimizer))
    # The step's state on the mesh: the tables keep their row sharding; the rest (which
    # a restored model gets back on one device) is replicated.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = jax.tree.map(
        lambda x: x if x.sharding.num_devices == mesh.size else jax.device_put(x, replicated),
        state)

    def train_step(state: nnx.State, inputs: embedding.PreprocessedInput, labels: jax.Array,
                   step: jax.Array) -> tuple[nnx.State, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model: Model) -> jax.Array:
            logits = model(inputs, step)
            return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    pipelined_step = auto_pipelining.auto_pipelining(train_step, out_shardings=None)
    pipeline = auto_pipelining.init_state()
    losses = []
    for step, (features, labels) in enumerate(batches, start=first_step):
        inputs, _ = preprocess(features, step, feature_specs, mesh.size, num_sc_per_device)
        labels = jax.device_put(labels, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec("device")))
        pipeline, (state, loss) = pipelined_step(pipeline, state, inputs, labels,
                                                 jnp.int32(step))
        if loss is not None:  # the dense part runs a step late: this is step - 1's loss
            losses.append(float(loss))
            print(f"step {step - 1}: loss {losses[-1]:.5f}")
    pipeline, (state, loss) = auto_pipelining.finalize_pipelining(pipelined_step, pipeline,
                                                                  state)
    losses.append(float(loss))
    print(f"step {first_step + len(batches) - 1}: loss {losses[-1]:.5f}")
    nnx.update((model, optimizer), state)
    return losses


def train(args: argparse.Namespace, workdir: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), axis_names=("device",))
    num_sc_per_device = utils.num_sparsecores_per_device(mesh.devices.item(0))
    rng = np.random.default_rng(0)
    batches = [make_batch(rng, args.batch, args.vocab) for _ in range(args.steps)]
    feature_specs = prepare_specs(args.batch, args.vocab, mesh.size, num_sc_per_device,
                                  workdir / "fdo", batches)
    limits = {name: s.max_ids_per_partition
              for name, s in embedding.get_stacked_table_specs(feature_specs).items()}
    print(f"{mesh.size} device(s) x {num_sc_per_device} SparseCores; "
          f"max_ids_per_partition after FDO: {limits}")

    model = Model(feature_specs, mesh, seed=0)
    optimizer = embed.PartitionedOptimizer(model, optax.adam(0.05))
    manager = checkpoint_utils.create_checkpoint_manager(
        cp_path=workdir / "checkpoints", cp_options=ocp.CheckpointManagerOptions())
    half = args.steps // 2
    losses = run_pipelined(model, optimizer, feature_specs, mesh, num_sc_per_device,
                           batches[:half], first_step=0)
    # Save half-way, then carry on in a fresh model restored from that checkpoint.
    checkpoint_utils.save_checkpoint(
        cp_manager=manager, step=half, model=model, optimizer=optimizer,
        feature_specs=feature_specs, num_global_devices=mesh.size,
        num_sc_per_device=num_sc_per_device)
    manager.wait_until_finished()
    model = Model(feature_specs, mesh, seed=1)
    optimizer = embed.PartitionedOptimizer(model, optax.adam(0.05))
    checkpoint_utils.restore_checkpoint(cp_manager=manager, step=half, model=model,
                                        optimizer=optimizer)
    print(f"step {half}: saved, and restored into a fresh model")
    losses += run_pipelined(model, optimizer, feature_specs, mesh, num_sc_per_device,
                            batches[half:], first_step=half)
    checkpoint_utils.save_checkpoint(
        cp_manager=manager, step=args.steps, model=model, optimizer=optimizer,
        feature_specs=feature_specs, num_global_devices=mesh.size,
        num_sc_per_device=num_sc_per_device)
    manager.wait_until_finished()
    manager.close()

    one_model, one_specs = one_device_model(args, workdir, num_sc_per_device, batches)
    want = batch_loss(model, feature_specs, mesh.size, num_sc_per_device, batches[-1],
                      args.steps)
    got = batch_loss(one_model, one_specs, 1, num_sc_per_device, batches[-1], args.steps)
    print(f"converted for 1 device: loss {got:.5f} (the {mesh.size}-device model: {want:.5f})")
    if not np.isclose(got, want, rtol=1e-5):
        raise SystemExit(f"port_from_reference: the converted checkpoint gives loss {got}, "
                         f"not {want}")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"port_from_reference: loss did not go down: {losses}")
    print(f"port_from_reference: OK (loss {losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
