"""The reference's nnx `SparseCoreEmbed` and `PartitionedOptimizer`
(`jax_tpu_embedding.sparsecore.lib.flax.nnx.embed`).

Port by changing the import to `from tilecore.compat.flax.nnx import embed`. As
in the reference the stacked variables are an `EmbeddingVariablesParam` (with
its `embedding_sharding` metadata, which `get_named_sharding` reports) whose
gradient from `nnx.grad` is the *updated* variables: `embedding_lookup` is an
`nnx.custom_vjp` whose backward pass (`embedding_lookup_bwd`) runs the fused
optimizer; `PartitionedOptimizer` copies those into the model while optax
updates the other parameters. `tilecore.layers.NnxEmbed` / `EmbedOptimizer` are
the native equivalents.

Differences: `num_sc_per_device` is an extra keyword (None or <= 0: those of the
mesh's first device, `utils.num_sparsecores_per_device`, 4 on CPU/GPU; it must
match `prepare_feature_specs_for_training`); the mesh's `sharding_axis` must
span the whole mesh (so G = `mesh.size` = `mesh.shape[sharding_axis]`, where
the reference's linen and nnx layers disagree); `PartitionedOptimizer` updates
only `nnx.Param`s besides the embedding variables (the reference's filter also
takes other variable types, which `nnx.grad` gives no gradient).
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ....utils import utils
from ...nn import embedding
from .. import _sparse
from ..linen.embed import resolve_mesh

Nested = embedding.Nested


class EmbeddingVariablesParam(nnx.Param):
    """The layer's `{stack: EmbeddingVariables}` (a Param, told apart by its type)."""


def get_named_sharding(node: nnx.Module | nnx.Optimizer, mesh: Mesh) -> Any:
    """The `nnx.StateSharding` of a model or optimizer, for `nnx.jit(in_shardings=...)`:
    embedding variables get their `embedding_sharding`, the rest their named sharding."""

    def sharding(_: Any, value: Any) -> Any:
        if isinstance(value, EmbeddingVariablesParam):
            return value.embedding_sharding
        return nnx.get_named_sharding(value, mesh)

    return nnx.StateSharding(nnx.map_state(sharding, nnx.state(node)))


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
        if num_sc_per_device is None or num_sc_per_device <= 0:
            num_sc_per_device = utils.num_sparsecores_per_device(self.mesh.devices.item(0))
        self.num_sc_per_device = num_sc_per_device
        self.embedding_table_partition = PartitionSpec(self.sharding_axis, None)
        self.data_partition = PartitionSpec(self.sharding_axis)
        self.num_shards = self.mesh.shape[self.sharding_axis]
        self._plan()  # fail early on unprepared specs or unsupported options
        self.embedding_table = EmbeddingVariablesParam(
            embedding.init_embedding_variables(
                rngs.params(), embedding.get_table_specs(feature_specs),
                NamedSharding(self.mesh, self.embedding_table_partition),
                num_sparsecore_per_device=num_sc_per_device,
                bypass_mesh_check=self.mesh.size != jax.device_count(),
            ),
            embedding_sharding=utils.embedding_table_format(self.mesh,
                                                            self.embedding_table_partition),
        )

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
        """Activations shaped like `feature_specs`; the tables' gradient is their updated values.

        `step` is the step the optimizers see (None: 0).
        """
        return embedding_lookup(self, embedding_lookup_inputs, step=step)

    def _device_call(self) -> _sparse.DeviceCall:
        self._plan()  # FDO may have changed the specs' limits since __init__
        return _sparse.DeviceCall(
            self.feature_specs, self.num_shards, self.num_sc_per_device,
            self.table_sharding_strategy, self.enable_minibatching,
            None if self.num_shards == 1 else self.mesh)


@nnx.custom_vjp
def embedding_lookup(embedding_layer: SparseCoreEmbed, embedding_lookup_inputs: Any,
                     step: Any = None) -> Any:
    """The layer's activations; under `nnx.grad` its `embedding_table` gradient is the
    updated variables (see `embedding_lookup_bwd`)."""
    del step  # used by the backward pass only
    return embedding_layer._device_call().lookup(embedding_lookup_inputs,
                                                 embedding_layer.embedding_table.get_value())


def _embedding_lookup_fwd(embedding_layer: SparseCoreEmbed, embedding_lookup_inputs: Any,
                          step: Any = None) -> tuple[Any, tuple[Any, Any, Any]]:
    out = embedding_lookup(embedding_layer, embedding_lookup_inputs, step=step)
    return out, (embedding_layer, embedding_lookup_inputs, step)


def embedding_lookup_bwd(res: tuple[Any, Any, Any], g: Any) -> tuple[Any, Any, Any]:
    """Backward pass: the layer's tangent holds, as `embedding_table`, the variables after
    one fused optimizer update with the activation gradients `g`."""
    embedding_layer, embedding_lookup_inputs, step = res
    (layer_updates_g, inputs_g, step_g), out_g = g
    layer_g = jax.tree.map(lambda x: x, layer_updates_g)  # a copy, as nnx asks
    layer_g["embedding_table"].set_value(embedding_layer._device_call().update(
        embedding_lookup_inputs, embedding_layer.embedding_table.get_value(), out_g, step))
    return layer_g, inputs_g, step_g


embedding_lookup.defvjp(_embedding_lookup_fwd, embedding_lookup_bwd)


def _value(variable: Any) -> Any:
    return variable.get_value() if hasattr(variable, "get_value") else variable


def _check_updated_variables(model: nnx.Module, updated: nnx.State) -> None:
    """Each embedding variable in the "gradients" has the stacks and shapes of the model's
    at the same path: `nnx.update` copied any tree in, replacing the model's tables with
    another model's (other stacks or shapes) without a word. A model variable absent
    from the gradients is left as it is, as in the reference."""
    have = dict(nnx.to_flat_state(nnx.state(model, EmbeddingVariablesParam)))
    for path, variable in nnx.to_flat_state(updated):
        name = "/".join(map(str, path))
        if path not in have:
            raise ValueError(f"PartitionedOptimizer.update: the gradients hold embedding "
                             f"variables at {name!r}, which the model does not have; pass the "
                             "gradients of this model.")
        new, old = _value(variable), _value(have[path])
        shapes = [{k: tuple(getattr(v, "shape", ())) for k, v in
                   jax.tree_util.tree_flatten_with_path(tree)[0]} for tree in (new, old)]
        if jax.tree.structure(new) != jax.tree.structure(old) or shapes[0] != shapes[1]:
            diffs = [f"{jax.tree_util.keystr(k)}: given {shapes[0].get(k, 'none')}, model "
                     f"{shapes[1].get(k, 'none')}"
                     for k in sorted(set(shapes[0]) | set(shapes[1]), key=str)
                     if shapes[0].get(k) != shapes[1].get(k)]
            raise ValueError(
                f"PartitionedOptimizer.update: the updated embedding variables at {name!r} do "
                "not fit the model's (" + ("; ".join(diffs[:4]) or "another tree structure")
                + "); pass the gradients of this model, computed with its feature specs."
            )


class PartitionedOptimizer(nnx.Optimizer):
    """optax for the dense parameters; the embedding "gradients" copied into the model."""

    def __init__(self, model: nnx.Module, dense_optimizer: optax.GradientTransformation) -> None:
        super().__init__(model, dense_optimizer,
                         wrt=nnx.All(nnx.Param, nnx.Not(EmbeddingVariablesParam)))

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> optax.Updates:
        """Copy the updated embedding variables into `model`, then update the rest."""
        updated = nnx.state(grads, EmbeddingVariablesParam)
        _check_updated_variables(model, updated)
        nnx.update(model, updated)
        return super().update(model, grads, **kwargs)
