"""The reference's nnx `SparseCoreEmbed` and `PartitionedOptimizer`
(`jax_tpu_embedding.sparsecore.lib.flax.nnx.embed`).

Port by changing the import to `from tilecore.compat.flax.nnx import embed`. As
in the reference the stacked variables are an `EmbeddingVariablesParam` whose
gradient (from `nnx.grad`) is the *updated* variables, and `PartitionedOptimizer`
copies them into the model while optax updates the other parameters.
`tilecore.layers.NnxEmbed` / `EmbedOptimizer` are the native equivalents.

Differences: `num_sc_per_device` is an extra keyword (None: 4; it must match
`prepare_feature_specs_for_training`); the mesh's `sharding_axis` must span the
whole mesh (so G = `mesh.size` = `mesh.shape[sharding_axis]`, where the
reference's linen and nnx layers disagree); `__call__` takes the step for the
optimizers that use it (default 0); minibatching raises.
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ...nn import embedding
from .. import _sparse
from ..linen.embed import resolve_mesh


class EmbeddingVariablesParam(nnx.Param):
    """The layer's `{stack: EmbeddingVariables}` (a Param, told apart by its type)."""


def is_embedding_variables(_: Any, value: Any) -> bool:
    """nnx filter: the embedding variables."""
    return isinstance(value, EmbeddingVariablesParam)


def is_non_embedding_variables(_: Any, value: Any) -> bool:
    """nnx filter: everything but the embedding variables."""
    return not isinstance(value, EmbeddingVariablesParam)


class SparseCoreEmbed(nnx.Module):
    """Embedding activations of prepared compat `feature_specs` (reference nnx API)."""

    def __init__(self, feature_specs: Any, sharding_axis: str, mesh: Mesh, rngs: nnx.Rngs, *,
                 enable_minibatching: bool = False, table_sharding_strategy: str = "MOD",
                 num_sc_per_device: int | None = None) -> None:
        self.feature_specs = feature_specs
        self.sharding_axis = _sparse.single_axis(sharding_axis, "SparseCoreEmbed")
        self.mesh = resolve_mesh(mesh, self.sharding_axis, "SparseCoreEmbed")
        self.table_sharding_strategy = table_sharding_strategy
        self.enable_minibatching = enable_minibatching
        self.num_sc_per_device = num_sc_per_device
        self.num_shards = self.mesh.size
        self._plan()  # fail early on unprepared specs or unsupported options
        self.embedding_table = EmbeddingVariablesParam(embedding.init_embedding_variables(
            rngs.params(), embedding.get_table_specs(feature_specs),
            NamedSharding(self.mesh, PartitionSpec(self.sharding_axis, None)),
            num_sparsecore_per_device=num_sc_per_device,
            bypass_mesh_check=self.mesh.size != jax.device_count(),
        ))

    def _plan(self) -> Any:
        """The native plan the specs record now (FDO may have changed their limits)."""
        return _sparse.make_plan(self.feature_specs, self.num_shards, self.num_sc_per_device,
                                 self.table_sharding_strategy, self.enable_minibatching,
                                 "SparseCoreEmbed")

    def preprocess_inputs(self, step: int, features: Any, features_weights: Any,
                          all_reduce_interface: Any = None) -> embedding.PreprocessedInput:
        """This process's batch preprocessed for the layer (a tilecore convenience)."""
        return embedding.preprocess_sparse_dense_matmul_input(
            features, features_weights, self.feature_specs,
            local_device_count=self.mesh.local_mesh.size, global_device_count=self.mesh.size,
            num_sc_per_device=self.num_sc_per_device,
            sharding_strategy=self.table_sharding_strategy, batch_number=step,
            enable_minibatching=self.enable_minibatching,
            all_reduce_interface=all_reduce_interface,
        )[0]

    def __call__(self, embedding_lookup_inputs: Any, step: Any = None) -> Any:
        """Activations shaped like `feature_specs`; the tables' gradient is their updated values."""
        plan = self._plan()
        batch = _sparse.native_batch(plan, embedding_lookup_inputs, "SparseCoreEmbed")
        mesh = None if self.num_shards == 1 else self.mesh
        return _sparse.lookup(self.feature_specs, plan, batch,
                              self.embedding_table.get_value(), step, mesh, self.sharding_axis)


class PartitionedOptimizer(nnx.Optimizer):
    """optax for the dense parameters; the embedding "gradients" copied into the model."""

    def __init__(self, model: nnx.Module, dense_optimizer: optax.GradientTransformation) -> None:
        super().__init__(model, dense_optimizer,
                         wrt=nnx.All(nnx.Param, nnx.Not(EmbeddingVariablesParam)))

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> optax.Updates:
        """Copy the updated embedding variables into `model`, then update the rest."""
        nnx.update(model, nnx.state(grads, EmbeddingVariablesParam))
        return super().update(model, grads, **kwargs)
