"""A custom optimizer rule and one compat training step checked against the numpy oracle,
shared by the compat and the reference-differential custom-optimizer tests."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from tilecore import ops
from tilecore.compat import embedding, embedding_spec
from tilecore.testing import reference_lookup_grad

DIM = 8


def normalised_momentum(grad: Any, row: Any, velocity: Any, lr: Any) -> tuple[Any, Any]:
    """A rule that couples a row's columns (its step shrinks with ‖velocity‖²); numpy or jnp."""
    velocity = 0.5 * velocity + grad
    scale = 1.0 + (velocity * velocity).sum(axis=-1, keepdims=True)
    return row - lr * velocity / scale, velocity


def compat_specs(optimizer: embedding_spec.OptimizerSpec) -> dict[str, Any]:
    table = embedding_spec.TableSpec(
        name="t", vocabulary_size=40, embedding_dim=DIM,
        initializer=jax.nn.initializers.normal(1.0), optimizer=optimizer, combiner="sum")
    specs = {"f": embedding_spec.FeatureSpec(name="f", table_spec=table, input_shape=[16, 2],
                                             output_shape=[16, DIM])}
    embedding.prepare_feature_specs_for_training(specs, global_device_count=1,
                                                 num_sc_per_device=2)
    return specs


def compat_step(optimizer: embedding_spec.OptimizerSpec,
                oracle: embedding_spec.OptimizerSpec, step: int = 2
                ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """One compat grad step on global arrays: the updated `[table, *slots]`, the
    oracle's (`reference_lookup_grad` with the `oracle` optimizer) and the old table."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tilecore.compat._native import build_plan

    specs = compat_specs(optimizer)
    mesh = Mesh(np.array(jax.devices()[:1]), "x")
    variables = embedding.init_embedding_variables(
        jax.random.key(0), embedding.get_table_specs(specs), NamedSharding(mesh, P("x", None)), 2)
    rng = np.random.default_rng(4)
    ids = {"f": rng.integers(0, 40, size=(16, 2)).astype(np.int32)}
    grads = {"f": rng.normal(size=(16, DIM)).astype(np.float32)}
    inputs, _ = embedding.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1,
                                                               num_sc_per_device=2)
    new = embedding.tpu_sparse_dense_matmul_grad(grads, inputs, variables, specs,
                                                 global_device_count=1, num_sc_per_device=2,
                                                 step=step)
    plan = build_plan(compat_specs(oracle), global_devices=1, sc_per_device=2)
    [stack] = plan.stacks

    def per_table(array: Any) -> np.ndarray:
        return ops.unshard(plan, {stack: np.asarray(array)})["t"]

    old = variables[stack]
    tables, slots = reference_lookup_grad(
        plan, ids, None, {"t": per_table(old.table)}, {"t": [per_table(s) for s in old.slot]},
        grads, step)
    got = [per_table(a) for a in (new[stack].table, *new[stack].slot)]
    return got, [tables["t"], *slots["t"]], per_table(old.table)


def compat_custom(**form: Any) -> embedding_spec.CustomOptimizerSpec:
    return embedding_spec.CustomOptimizerSpec(
        learning_rate=0.2, slot_variable_initializers_tuple=(jax.nn.initializers.constant(0.25),),
        short_name_str="mine", **form)
