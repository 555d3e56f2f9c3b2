"""Specs ⇄ spec protos (`jax_tpu_embedding.sparsecore.lib.nn.embedding_proto_utils`).

`create_proto_from_feature_specs` records how prepared feature specs stack and
shard their tables, so trained tables can later be unstacked for serving
(`table_stacking.unstack_and_unshard_stacked_tables`) or restacked for another
topology; the optimizer helpers convert optimizer specs to and from
`OptimizerSpecProto`. The protos are wire-compatible with the reference's.

Where the reference accepts bad input silently, these raise: a learning rate or
hyperparameter that is not a number (nor a callable learning rate), a proto
type that is no `OptimizerType`, parameters the optimizer does not take, specs
stacked for another number of SparseCores.
"""

from __future__ import annotations

from typing import Any

from ..._optimizers import OptimizerSpec
from ..._protos import CLASS_OF_TYPE, TYPE_OF_CLASS, feature_specs_to_proto
from ..._protos import optimizer_from_proto as _optimizer_from_proto
from ..._protos import optimizer_to_proto as _optimizer_to_proto
from ..proto import embedding_spec_pb2

__all__ = [
    "create_proto_from_feature_specs",
    "get_optimizer_class",
    "get_optimizer_type",
    "optimizer_spec_to_proto",
    "proto_to_optimizer_spec",
]


def get_optimizer_class(optimizer_type: int) -> type[OptimizerSpec] | None:
    """The optimizer spec class of an `OptimizerSpecProto.OptimizerType`, or None (e.g. CUSTOM)."""
    return CLASS_OF_TYPE.get(optimizer_type)


def get_optimizer_type(optimizer_class: type[OptimizerSpec]) -> int:
    """The `OptimizerSpecProto.OptimizerType` of an optimizer spec class; CUSTOM if it has none.

    The match is by exact class (a subclass is CUSTOM), as in the reference;
    `LaPropOptimizerSpec` and `CustomOptimizerSpec` are CUSTOM.
    """
    return TYPE_OF_CLASS.get(optimizer_class, embedding_spec_pb2.OptimizerSpecProto.CUSTOM)


def optimizer_spec_to_proto(
    opt: OptimizerSpec | None,
) -> embedding_spec_pb2.OptimizerSpecProto | None:
    """`opt` as an `OptimizerSpecProto` (None for None).

    A numeric learning rate is stored as `learning_rate` (a 32-bit float); a
    callable one as `learning_rate_tag` (its `tag` attribute, else its qualified
    name). CUSTOM optimizers store no hyperparameters.
    """
    return _optimizer_to_proto(opt)


def proto_to_optimizer_spec(
    proto: embedding_spec_pb2.OptimizerSpecProto | None,
) -> OptimizerSpec:
    """The optimizer spec an `OptimizerSpecProto` describes.

    None, an UNSPECIFIED type and a CUSTOM type (whose update rule the proto does
    not keep) give `SGDOptimizerSpec`; a tagged learning rate becomes an
    `embedding_spec.CallablePlaceholder` that cannot be evaluated.
    """
    return _optimizer_from_proto(proto)


def create_proto_from_feature_specs(
    feature_specs: Any,
    global_device_count: int | None,
    num_sparsecore_per_device: int | None = None,
) -> embedding_spec_pb2.EmbeddingSpecProto:
    """The `EmbeddingSpecProto` of feature specs prepared for training.

    Args:
      feature_specs: a pytree (list, dict, …) of stacked `FeatureSpec`s (after
        `embedding.prepare_feature_specs_for_training`).
      global_device_count: devices the specs were prepared for (None:
        `jax.device_count()`).
      num_sparsecore_per_device: SparseCores per device (None: tilecore's default
        of 4, where the reference asks the TPU).

    Returns:
      One `StackedTableSpecProto` per stack with its tables' places and features.
    """
    return feature_specs_to_proto(feature_specs, global_device_count, num_sparsecore_per_device)
