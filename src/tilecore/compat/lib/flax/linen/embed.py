"""The reference's linen `SparseCoreEmbed` (`jax_tpu_embedding.sparsecore.lib.flax.linen.embed`).

Port by changing the import to `from tilecore.compat.flax.linen import embed`.
As in the reference, the stacked variables are the parameter
`sc_embedding_variables` (in `"params"`, boxed in `WithSparseCoreLayout`, an
`nn.Partitioned` over `(sharding_axis, None)` whose sharding is
`utils.embedding_table_format`), and their "gradient" is the *updated*
variables: the lookup's VJP runs each stack's fused optimizer
(`tpu_sparse_dense_matmul_grad`) at step 0, as the reference's does. Pair it with
`embed_optimizer.create_optimizer_for_sc_model` / `apply_updates_for_sc_model`.
`tilecore.layers.LinenEmbed` is the native layer, which keeps tables out of
`"params"` and never passes updated tables off as gradients.

As in the reference the mesh is the field `_mesh` (None: every device along
`sharding_axis`) and `num_sc_per_device` (default -1) is resolved in
`__post_init__` from the mesh's first device (`utils.num_sparsecores_per_device`:
4 on CPU/GPU). Differences: a positive `num_sc_per_device` is kept (the
reference overwrites it; it must match `prepare_feature_specs_for_training`);
tables are sharded over one mesh axis spanning the whole mesh (so G =
`mesh.shape[sharding_axis]` = `mesh.size`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import flax.linen as nn
import jax
import numpy as np
from flax import typing as flax_typing
from flax.core import meta
from jax.experimental import layout as jax_layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ....utils import utils
from ...nn import embedding
from .. import _sparse

LogicalNames = flax_typing.LogicalNames
Nested = embedding.Nested
EmbeddingLookupInput = embedding.PreprocessedInput

EMBEDDING_PARAM_NAME = "sc_embedding_variables"

AxisName = str | tuple[str, ...] | None
PartitionNames = tuple[AxisName, ...] | LogicalNames

A = TypeVar("A")

EmbeddingInitializer = Callable[[jax.Array], Mapping[str, embedding.EmbeddingVariables]]


class WithSparseCoreLayout(nn.Partitioned[A]):
    """`nn.Partitioned` whose sharding is the embedding-table format
    (`utils.embedding_table_format`: the plain sharding off TPU)."""

    def get_sharding(self, mesh: Mesh) -> jax.sharding.Sharding | jax_layout.Format:  # type: ignore[override]
        if mesh is None:
            raise ValueError("WithSparseCoreLayout.get_sharding needs a mesh, got None.")
        return utils.embedding_table_format(mesh, self.get_partition_spec())


SparseCoreLayoutInitializer = Callable[
    [jax.Array], WithSparseCoreLayout[Mapping[str, embedding.EmbeddingVariables]]
]


def with_sparsecore_layout(fn: EmbeddingInitializer, names: PartitionNames, mesh: Mesh
                           ) -> SparseCoreLayoutInitializer:
    """`fn` with its result boxed in `WithSparseCoreLayout(result, names, mesh=mesh)`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> WithSparseCoreLayout[Any]:
        return WithSparseCoreLayout(fn(*args, **kwargs), names, mesh=mesh)  # type: ignore[arg-type]

    return wrapper


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
      _mesh: the mesh (None: every device along `sharding_axis`); read it as `mesh`.
      table_sharding_strategy: only "MOD".
      enable_minibatching: split batches over the limits into minibatches.
      num_sc_per_device: logical SparseCores per device (<= 0: resolved from the
        mesh's first device in `__post_init__`).
    """

    feature_specs: Any
    sharding_axis: str | tuple[str, ...] = "sparsecore_sharding"
    _mesh: Mesh | None = None
    table_sharding_strategy: str = "MOD"
    enable_minibatching: bool = False
    num_sc_per_device: int = -1

    def __post_init__(self) -> None:
        self._mesh = resolve_mesh(self._mesh, self._axis, "SparseCoreEmbed")
        if self.num_sc_per_device is None or self.num_sc_per_device <= 0:
            self.num_sc_per_device = utils.num_sparsecores_per_device(self._mesh.devices.item(0))
        super().__post_init__()

    @property
    def _axis(self) -> str:
        return _sparse.single_axis(self.sharding_axis, "SparseCoreEmbed")

    @property
    def mesh(self) -> Mesh:
        """The resolved mesh."""
        assert self._mesh is not None  # resolved in __post_init__
        return self._mesh

    @property
    def embedding_table_partition(self) -> PartitionSpec:
        """Tables: rows split over `sharding_axis`."""
        return PartitionSpec(self.sharding_axis, None)

    @property
    def data_partition(self) -> PartitionSpec:
        """Preprocessed inputs and activations: split over `sharding_axis`."""
        return PartitionSpec(self.sharding_axis)

    @property
    def num_shards(self) -> int:
        """G: devices the tables are sharded over."""
        return self.mesh.shape[self._axis]

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

    def _device_call(self) -> _sparse.DeviceCall:
        self._plan()  # unprepared specs or unsupported options fail here, naming the layer
        return _sparse.DeviceCall(
            self.feature_specs, self.num_shards, self.num_sc_per_device,
            self.table_sharding_strategy, self.enable_minibatching,
            None if self.num_shards == 1 else self.mesh)

    def setup(self) -> None:
        if not (self.is_initializing() or self.has_variable("params", EMBEDDING_PARAM_NAME)):
            raise ValueError(
                f"SparseCoreEmbed: the parameter {EMBEDDING_PARAM_NAME!r} is missing from "
                "params; initialise with model.init(key, preprocessed_inputs) and apply with "
                "the params it returned."
            )
        mesh = self.mesh
        initializer = functools.partial(
            embedding.init_embedding_variables,
            table_specs=embedding.get_table_specs(_sparse.plain_specs(self.feature_specs)),
            global_sharding=NamedSharding(mesh, self.embedding_table_partition),
            num_sparsecore_per_device=self.num_sc_per_device,
            bypass_mesh_check=mesh.size != jax.device_count(),
        )
        self.param(EMBEDDING_PARAM_NAME, self._wrap_initializer(initializer))

    def _wrap_initializer(self, initializer: EmbeddingInitializer) -> SparseCoreLayoutInitializer:
        return with_sparsecore_layout(fn=initializer, names=(self.sharding_axis, None),
                                      mesh=self.mesh)

    def preprocess_inputs(self, step: int, features: Any, features_weights: Any,
                          all_reduce_interface: Any = None) -> embedding.PreprocessedInput:
        """This process's batch preprocessed for the layer (host side; needs no `apply`)."""
        mesh = self.mesh
        return embedding.preprocess_sparse_dense_matmul_input(
            features, features_weights, _sparse.plain_specs(self.feature_specs),
            local_device_count=mesh.local_mesh.size, global_device_count=mesh.size,
            num_sc_per_device=self.num_sc_per_device,
            sharding_strategy=self.table_sharding_strategy, batch_number=step,
            enable_minibatching=self.enable_minibatching,
            all_reduce_interface=all_reduce_interface,
        )[0]

    def __call__(self, embedding_lookup_inputs: Any) -> Any:
        """Activations shaped like `feature_specs`; the tables' VJP is their updated values.

        As in the reference, tables of another dtype (e.g. bfloat16) are looked up
        in float32 and each activation comes back in its table's dtype.
        """
        call = self._device_call()
        table = self.embedding_table
        if table is None:
            raise ValueError(
                "SparseCoreEmbed reads the embedding variables: call it through "
                "model.init(key, inputs) or model.apply(params, inputs) (or inside a module "
                "that is)."
            )
        acts = call.lookup_updating(embedding_lookup_inputs, _sparse.as_float32(table), None)
        return _sparse.in_table_dtypes(self.feature_specs, acts, table)

    def apply_gradient(self, gradients: Any, embedding_lookup_inputs: Any) -> dict[str, Any]:
        """`{"<module path>/sc_embedding_variables": updated variables}` after one update."""
        if self.scope is None:
            raise ValueError(
                "SparseCoreEmbed.apply_gradient reads the embedding variables: call it through "
                "model.apply(params, gradients, inputs, method=SparseCoreEmbed.apply_gradient)."
            )
        table = self.embedding_table
        updated = self._device_call().update(embedding_lookup_inputs,
                                             _sparse.as_float32(table),
                                             _sparse.as_float32(gradients), None)
        return {"/".join((*self.scope.path, EMBEDDING_PARAM_NAME)):
                _sparse.like_dtypes(updated, table)}
