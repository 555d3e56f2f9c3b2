"""The reference's linen `SparseCoreEmbed` (`jax_tpu_embedding.sparsecore.lib.flax.linen.embed`).

Port by changing the import to `from tilecore.compat.flax.linen import embed`.
As in the reference, the stacked variables are the parameter
`sc_embedding_variables` (in `"params"`, boxed in `nn.Partitioned` over
`(sharding_axis, None)`), and their "gradient" is the *updated* variables: the
lookup's VJP runs each stack's fused optimizer (`tilecore.ops.lookup_grad`)
at step 0, as the reference's does. Pair it with
`embed_optimizer.create_optimizer_for_sc_model` / `apply_updates_for_sc_model`.
`tilecore.layers.LinenEmbed` is the native layer, which keeps tables out of
`"params"` and never passes updated tables off as gradients.

Differences: `num_sc_per_device` is a field (None: 4, tilecore's default
logical SparseCores per device; it must match `prepare_feature_specs_for_training`);
tables are sharded over one mesh axis spanning the whole mesh (so G =
`mesh.shape[sharding_axis]` = `mesh.size`); minibatching raises.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ...nn import embedding
from .. import _sparse

EMBEDDING_PARAM_NAME = "sc_embedding_variables"


def resolve_mesh(mesh: Mesh | None, axis: str, layer: str) -> Mesh:
    """`mesh`, or one over every device along `axis`; its embedding axis must span it."""
    if mesh is None:
        mesh = Mesh(np.asarray(jax.devices()), (axis,))
    if axis not in mesh.shape or mesh.shape[axis] != mesh.size:
        raise NotImplementedError(
            f"{layer}: the mesh {dict(mesh.shape)} must have axis {axis!r} spanning all its "
            "devices; tilecore shards tables over one axis of the whole mesh."
        )
    return mesh


class SparseCoreEmbed(nn.Module):
    """Embedding activations of prepared compat `feature_specs` (reference linen API).

    Attributes:
      feature_specs: prepared `tilecore.compat.embedding_spec.FeatureSpec`s (nested).
      sharding_axis: the mesh axis tables and batches are split over.
      mesh: the mesh (None: every device along `sharding_axis`).
      table_sharding_strategy: only "MOD".
      enable_minibatching: not supported (raises).
      num_sc_per_device: logical SparseCores per device (None: 4).
    """

    feature_specs: Any
    sharding_axis: str | tuple[str, ...] = "sparsecore_sharding"
    mesh: Mesh | None = None
    table_sharding_strategy: str = "MOD"
    enable_minibatching: bool = False
    num_sc_per_device: int | None = None

    @property
    def _axis(self) -> str:
        return _sparse.single_axis(self.sharding_axis, "SparseCoreEmbed")

    @property
    def resolved_mesh(self) -> Mesh:
        return resolve_mesh(self.mesh, self._axis, "SparseCoreEmbed")

    @property
    def num_shards(self) -> int:
        """G: devices the tables are sharded over."""
        return self.resolved_mesh.shape[self._axis]

    @property
    def embedding_table(self) -> Any:
        """The (unboxed) `{stack: EmbeddingVariables}`, or None outside `apply`/before `init`."""
        if self.scope is None or not self.has_variable("params", EMBEDDING_PARAM_NAME):
            return None
        return meta.unbox(self.get_variable("params", EMBEDDING_PARAM_NAME))

    def _plan(self) -> Any:
        return _sparse.make_plan(self.feature_specs, self.num_shards, self.num_sc_per_device,
                                 self.table_sharding_strategy, self.enable_minibatching,
                                 "SparseCoreEmbed")

    def _ops_mesh(self) -> Mesh | None:
        return None if self.num_shards == 1 else self.resolved_mesh

    def setup(self) -> None:
        if not (self.is_initializing() or self.has_variable("params", EMBEDDING_PARAM_NAME)):
            raise ValueError(
                f"SparseCoreEmbed: the parameter {EMBEDDING_PARAM_NAME!r} is missing from "
                "params; initialise with model.init(key, preprocessed_inputs) and apply with "
                "the params it returned."
            )
        mesh, axis = self.resolved_mesh, self._axis

        def init(rng: jax.Array) -> nn.Partitioned:
            variables = embedding.init_embedding_variables(
                rng, embedding.get_table_specs(_sparse.plain_specs(self.feature_specs)),
                NamedSharding(mesh, PartitionSpec(axis, None)),
                num_sparsecore_per_device=self.num_sc_per_device,
                bypass_mesh_check=mesh.size != jax.device_count(),
            )
            return nn.Partitioned(variables, names=(axis, None), mesh=mesh)

        self.param(EMBEDDING_PARAM_NAME, init)

    def preprocess_inputs(self, step: int, features: Any, features_weights: Any,
                          all_reduce_interface: Any = None) -> embedding.PreprocessedInput:
        """This process's batch preprocessed for the layer (host side; needs no `apply`)."""
        mesh = self.resolved_mesh
        return embedding.preprocess_sparse_dense_matmul_input(
            features, features_weights, _sparse.plain_specs(self.feature_specs),
            local_device_count=mesh.local_mesh.size, global_device_count=mesh.size,
            num_sc_per_device=self.num_sc_per_device,
            sharding_strategy=self.table_sharding_strategy, batch_number=step,
            enable_minibatching=self.enable_minibatching,
            all_reduce_interface=all_reduce_interface,
        )[0]

    def __call__(self, embedding_lookup_inputs: Any) -> Any:
        """Activations shaped like `feature_specs`; the tables' VJP is their updated values."""
        plan = self._plan()
        batch = _sparse.native_batch(plan, embedding_lookup_inputs, "SparseCoreEmbed")
        return _sparse.lookup(self.feature_specs, plan, batch, self.embedding_table, None,
                              self._ops_mesh(), self._axis)

    def apply_gradient(self, gradients: Any, embedding_lookup_inputs: Any) -> dict[str, Any]:
        """`{"<module path>/sc_embedding_variables": updated variables}` after one update."""
        if self.scope is None:
            raise ValueError(
                "SparseCoreEmbed.apply_gradient reads the embedding variables: call it through "
                "model.apply(params, gradients, inputs, method=SparseCoreEmbed.apply_gradient)."
            )
        plan = self._plan()
        batch = _sparse.native_batch(plan, embedding_lookup_inputs, "SparseCoreEmbed")
        updated = _sparse.update(self.feature_specs, plan, batch, self.embedding_table,
                                 gradients, None, self._ops_mesh(), self._axis)
        return {"/".join((*self.scope.path, EMBEDDING_PARAM_NAME)): updated}
