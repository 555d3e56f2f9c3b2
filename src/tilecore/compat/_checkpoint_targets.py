"""Target specs for a checkpoint converted without target feature specs.

From the source `EmbeddingSpecProto` alone, rebuild FeatureSpecs (optionally
with a new global batch size) and stack them for the target topology, as the
reference's offline converter does: when the proto records combiners and
optimizers the tables are regrouped with `auto_stack_tables`; otherwise the
source stacks are kept (and a multi-table stack whose activations per SparseCore
would exceed its limit on the target raises). The stacking itself is compat's
(`embedding.auto_stack_tables`, `table_stacking.stack_tables`).
"""

from __future__ import annotations

import collections
from typing import Any

from ..specs import DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
from ..specs._numbers import is_integer
from ._optimizers import SGDOptimizerSpec
from ._specs import FeatureSpec, TableSpec


def _has_full_metadata(proto: Any) -> bool:
    return any(t.combiner and t.HasField("optimizer")
               for s in proto.stacked_table_specs for t in s.table_specs)


def _scaled(shape: Any, batch: int | None) -> tuple[int, ...]:
    out = [int(d) for d in shape]
    if batch is not None and out:
        out[0] = batch
    return tuple(out)


def feature_specs_from_proto(proto: Any, target_batch_size: int | None,
                             keep_limits: bool) -> collections.OrderedDict[str, FeatureSpec]:
    """Unstacked FeatureSpecs the proto describes (feature name → spec, in proto order)."""
    from .lib.nn.embedding_proto_utils import proto_to_optimizer_spec

    if target_batch_size is not None and (not is_integer(target_batch_size) or target_batch_size < 1):
        raise ValueError(f"target_batch_size must be an integer >= 1 (or None: the saved "
                         f"one), got {target_batch_size!r}.")

    specs: collections.OrderedDict[str, FeatureSpec] = collections.OrderedDict()
    for stack in proto.stacked_table_specs:
        for t in stack.table_specs:
            table = TableSpec(
                name=t.table_name, vocabulary_size=t.vocab_size, embedding_dim=t.embedding_dim,
                initializer=None, combiner=t.combiner or "mean",
                optimizer=(proto_to_optimizer_spec(t.optimizer) if t.HasField("optimizer")
                           else SGDOptimizerSpec()),  # a placeholder: never applied
                max_ids_per_partition=(keep_limits and stack.max_ids_per_partition) or 256,
                max_unique_ids_per_partition=(
                    (keep_limits and stack.max_unique_ids_per_partition) or 256))
            for f in t.feature_specs:
                specs[f.feature_name] = FeatureSpec(
                    name=f.feature_name, table_spec=table,
                    input_shape=_scaled(f.input_shape, target_batch_size),
                    output_shape=_scaled(f.output_shape, target_batch_size))
            if not t.feature_specs:
                batch = target_batch_size or stack.total_sample_count
                name = f"feature_{t.table_name}"
                specs[name] = FeatureSpec(name=name, table_spec=table, input_shape=(batch, 1),
                                          output_shape=(batch, t.embedding_dim))
    return specs


def _limit(stack: Any) -> int:
    return (stack.activation_mem_bytes_limit if stack.HasField("activation_mem_bytes_limit")
            else DEFAULT_ACTIVATION_MEM_BYTES_LIMIT)


def _check_activations(proto: Any, specs: dict[str, FeatureSpec], num_shards: int,
                       where: str) -> None:
    """The reference's rule: a kept multi-table stack must fit its activation limit."""
    for stack in proto.stacked_table_specs:
        names = {t.table_name for t in stack.table_specs}
        if len(names) < 2:
            continue
        used = sum(-(-f.table_spec.embedding_dim // 8) * 8
                   * (int(f.output_shape[0]) if f.output_shape else 0) // num_shards * 4
                   for f in specs.values() if f.table_spec.name in names)
        if used > _limit(stack):
            raise ValueError(
                f"Stack {stack.stack_name!r} of {where} has per-SparseCore activation memory of "
                f"{used} bytes on the target ({num_shards} SparseCores), over its limit of "
                f"{_limit(stack)} bytes, so the target model stacks its tables differently. "
                "Pass target_feature_specs to convert_cross_topology_checkpoint."
            )


def target_specs(proto: Any, num_global_devices: int, num_sc_per_device: int,
                 target_batch_size: int | None, where: str) -> tuple[Any, dict[str, TableSpec]]:
    """(target proto, table name → stacked TableSpec) for the target topology."""
    from .lib.nn import embedding, table_stacking
    from .lib.nn.embedding_proto_utils import create_proto_from_feature_specs

    full = _has_full_metadata(proto)
    specs = feature_specs_from_proto(proto, target_batch_size, keep_limits=not full)
    if full:
        embedding.auto_stack_tables(specs, num_global_devices, num_sc_per_device,
                                    activation_mem_bytes_limit=_limit(proto.stacked_table_specs[0]))
    else:
        _check_activations(proto, specs, num_global_devices * num_sc_per_device, where)
        for stack in proto.stacked_table_specs:
            names = [t.table_name for t in stack.table_specs]
            if len(names) > 1 or names[0] != stack.stack_name:
                table_stacking.stack_tables(
                    specs, names, num_global_devices, num_sc_per_device,
                    stack_to_max_ids_per_partition=lambda *_, s=stack: s.max_ids_per_partition,
                    stack_to_max_unique_ids_per_partition=(
                        lambda *_, s=stack: s.max_unique_ids_per_partition),
                    stack_name=stack.stack_name)
    embedding.prepare_feature_specs_for_training(specs, num_global_devices, num_sc_per_device)
    target = create_proto_from_feature_specs(specs, num_global_devices, num_sc_per_device)
    if not full:  # like the source: no combiners or optimizers (the placeholders are not facts)
        for stack in target.stacked_table_specs:
            for table in stack.table_specs:
                table.ClearField("combiner")
                table.ClearField("optimizer")
    return target, embedding.get_table_specs(specs)
