"""Compat specs ⇄ the reference's spec protos (`EmbeddingSpecProto`, `OptimizerSpecProto`).

An optimizer is stored as its `OptimizerType`, its learning rate (a float, or
the tag of a schedule callable) and its hyperparameters split into `float_params`
and `bool_params` under the constructor's argument names. A stack is stored with
its tables' places (`TableSettingInStack`) and its features' ID transforms, as
`embedding_proto_utils.create_proto_from_feature_specs` writes them.
"""

from __future__ import annotations

import collections
import logging
import numbers
from typing import Any, TypeVar

import numpy as np
from google.protobuf.message import Message

from ._native import feature_leaves, stack_of, topology
from ._optimizers import (
    AdagradMomentumOptimizerSpec,
    AdagradOptimizerSpec,
    AdamOptimizerSpec,
    F2AOptimizerSpec,
    FTRLOptimizerSpec,
    OptimizerSpec,
    SGDOptimizerSpec,
)
from ._placeholder import CallablePlaceholder
from ._specs import FeatureSpec, StackedTableSpec, TableSpec
from .lib.proto import embedding_spec_pb2 as pb

_log = logging.getLogger(__name__)
_OptimizerProto = pb.OptimizerSpecProto

CLASS_OF_TYPE: dict[int, type[OptimizerSpec]] = {
    _OptimizerProto.SGD: SGDOptimizerSpec,
    _OptimizerProto.ADAGRAD: AdagradOptimizerSpec,
    _OptimizerProto.ADAM: AdamOptimizerSpec,
    _OptimizerProto.FTRL: FTRLOptimizerSpec,
    _OptimizerProto.F2A: F2AOptimizerSpec,
    _OptimizerProto.ADAGRAD_MOMENTUM: AdagradMomentumOptimizerSpec,
}
TYPE_OF_CLASS: dict[type[OptimizerSpec], int] = {cls: t for t, cls in CLASS_OF_TYPE.items()}

M = TypeVar("M", bound=Message)


def as_message(value: object, cls: type[M], argument: str) -> M:
    """`value` as a `cls` message; an equal message of another pool (the reference's) is re-read."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Message) and (
        value.DESCRIPTOR.full_name == cls.DESCRIPTOR.full_name
    ):
        return cls.FromString(value.SerializeToString())
    raise TypeError(
        f"{argument} must be a {cls.__name__} (tilecore.compat.lib.proto.embedding_spec_pb2), got "
        f"{type(value).__name__}. Parse serialized bytes with {cls.__name__}.FromString(data)."
    )


def _scalar(owner: str, name: str, value: Any) -> float:
    """`value` as a float if it is a real scalar (Python, numpy or 0-d array), else an error."""
    if isinstance(value, numbers.Real) or (
        isinstance(getattr(value, "dtype", None), np.dtype) and np.ndim(value) == 0
        and np.issubdtype(value.dtype, np.number)
    ):
        return float(value)
    raise ValueError(
        f"{owner}: {name}={value!r} cannot be stored in an OptimizerSpecProto, which holds "
        "numbers; give a float."
    )


def learning_rate_tag(learning_rate: Any) -> str | None:
    """The tag a callable learning rate is stored under (None for a number).

    Its `tag` attribute if set; else `module.qualname`; a lambda gets
    `<type>_<id>` (unique within the process only).
    """
    if not callable(learning_rate) or isinstance(learning_rate, numbers.Real):
        return None
    tag = getattr(learning_rate, "tag", None)
    if tag:
        return str(tag)
    name = getattr(learning_rate, "__qualname__", getattr(learning_rate, "__name__", ""))
    if name and name != "<lambda>":
        module = getattr(learning_rate, "__module__", "")
        return f"{module}.{name}" if module else name
    return f"{type(learning_rate).__name__}_{id(learning_rate)}"


def optimizer_to_proto(opt: OptimizerSpec | None) -> pb.OptimizerSpecProto | None:
    """The proto of `opt`; a class without an `OptimizerType` is `CUSTOM`, without parameters."""
    if opt is None:
        return None
    if not isinstance(opt, OptimizerSpec):
        raise TypeError(
            "optimizer_spec_to_proto takes a tilecore.compat embedding_spec optimizer spec "
            f"(e.g. embedding_spec.AdagradOptimizerSpec), got {type(opt).__name__}: {opt!r}."
        )
    owner = type(opt).__name__
    opt_type = TYPE_OF_CLASS.get(type(opt), _OptimizerProto.CUSTOM)
    try:
        floats, bools = (
            ({}, {}) if opt_type == _OptimizerProto.CUSTOM
            else (opt.get_float_params(), opt.get_bool_params())
        )
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{owner}: its hyperparameters cannot be stored in an OptimizerSpecProto, which "
            f"holds numbers ({err}); give floats."
        ) from err
    proto = pb.OptimizerSpecProto(type=opt_type, float_params=floats, bool_params=bools)
    tag = learning_rate_tag(opt.learning_rate)
    if tag:
        proto.learning_rate_tag = tag
    else:
        proto.learning_rate = _scalar(owner, "learning_rate", opt.learning_rate)
    return proto


def optimizer_from_proto(proto: object) -> OptimizerSpec:
    """The spec a proto describes: None or an `UNSPECIFIED`/`CUSTOM` type give SGD.

    A tagged learning rate becomes a `CallablePlaceholder`. A `CUSTOM` proto keeps
    no update rule, so (as in the reference) it reads back as SGD, with a warning.
    """
    if proto is None:
        return SGDOptimizerSpec(learning_rate=0.0)
    proto = as_message(proto, pb.OptimizerSpecProto, "proto")
    if proto.WhichOneof("learning_rate_spec") == "learning_rate_tag":
        learning_rate: Any = CallablePlaceholder(proto.learning_rate_tag)
    else:
        learning_rate = proto.learning_rate
    cls = CLASS_OF_TYPE.get(proto.type)
    if cls is None:
        if proto.type not in _OptimizerProto.OptimizerType.values():
            raise ValueError(
                f"OptimizerSpecProto has type={proto.type}, which is no OptimizerType (known: "
                f"{dict(_OptimizerProto.OptimizerType.items())}); the proto comes from a newer "
                "writer or is corrupt."
            )
        if proto.type == _OptimizerProto.CUSTOM:
            _log.warning("OptimizerSpecProto of type CUSTOM keeps no update rule; reading it "
                         "as SGDOptimizerSpec(learning_rate=%r).", learning_rate)
        return SGDOptimizerSpec(learning_rate=learning_rate)
    unknown = sorted((set(proto.float_params) - set(cls._float_params))
                     | (set(proto.bool_params) - set(cls._bool_params)))
    if unknown:
        raise ValueError(
            f"OptimizerSpecProto of type {_OptimizerProto.OptimizerType.Name(proto.type)} has "
            f"parameters {unknown} that {cls.__name__} does not take (it takes floats "
            f"{cls._float_params} and bools {cls._bool_params}); the proto comes from another "
            "version or is corrupt."
        )
    return cls.from_float_and_bool_params(
        dict(proto.float_params), dict(proto.bool_params), learning_rate=learning_rate
    )


def _stack_proto(stacked: StackedTableSpec, num_sparsecores: int) -> pb.StackedTableSpecProto:
    if stacked.stack_vocab_size % num_sparsecores:
        raise ValueError(
            f"Stack {stacked.stack_name!r}: stack_vocab_size={stacked.stack_vocab_size} does not "
            f"split over {num_sparsecores} SparseCores (global_device_count × "
            "num_sparsecore_per_device); the specs were stacked for another topology. Prepare "
            "them for this one, or pass the counts they were prepared for."
        )
    return pb.StackedTableSpecProto(
        stack_name=stacked.stack_name, stack_vocab_size=stacked.stack_vocab_size,
        stack_embedding_dim=stacked.stack_embedding_dim,
        total_sample_count=stacked.total_sample_count,
        max_ids_per_partition=stacked.max_ids_per_partition,
        max_unique_ids_per_partition=stacked.max_unique_ids_per_partition,
        num_sparsecores=num_sparsecores,
        activation_mem_bytes_limit=stacked.activation_mem_bytes_limit,
    )


def _table_proto(table: TableSpec) -> pb.TableSpecProto:
    setting = table.setting_in_stack
    return pb.TableSpecProto(
        table_name=table.name, vocab_size=table.vocabulary_size,
        embedding_dim=table.embedding_dim, padded_vocab_size=setting.padded_vocab_size,
        padded_embedding_dim=setting.padded_embedding_dim,
        row_offset_in_shard=setting.row_offset_in_shard, shard_rotation=setting.shard_rotation,
        combiner=table.combiner, optimizer=optimizer_to_proto(table.optimizer),
    )


def _feature_proto(feature: FeatureSpec) -> pb.FeatureSpecProto:
    transform = feature.id_transformation
    return pb.FeatureSpecProto(
        feature_name=feature.name, row_offset=transform.row_offset,
        col_offset=transform.col_offset, col_shift=transform.col_shift,
        input_shape=[int(d) for d in feature.input_shape],
        output_shape=[int(d) for d in feature.output_shape],
    )


def feature_specs_to_proto(
    feature_specs: Any, global_device_count: int | None, num_sparsecore_per_device: int | None
) -> pb.EmbeddingSpecProto:
    """The `EmbeddingSpecProto` of prepared (stacked) feature specs.

    Stacks, and tables within a stack, appear in order of their first feature
    among the pytree leaves; each table lists its features in that order.
    """
    if global_device_count is None:
        import jax  # deferred: the rest of this module is host-side

        global_device_count = jax.device_count()
    num_sparsecores = topology(global_device_count, num_sparsecore_per_device).num_partitions
    stacks: dict[str, pb.StackedTableSpecProto] = {}
    tables: dict[str, dict[str, pb.TableSpecProto]] = collections.defaultdict(dict)
    for feature in feature_leaves(feature_specs):
        stacked = stack_of(feature)
        if stacked.stack_name not in stacks:
            stacks[stacked.stack_name] = _stack_proto(stacked, num_sparsecores)
        by_name = tables[stacked.stack_name]
        if feature.table_spec.name not in by_name:
            by_name[feature.table_spec.name] = _table_proto(feature.table_spec)
        by_name[feature.table_spec.name].feature_specs.append(_feature_proto(feature))
    for name, by_name in tables.items():
        stacks[name].table_specs.extend(by_name.values())
    return pb.EmbeddingSpecProto(stacked_table_specs=stacks.values())
