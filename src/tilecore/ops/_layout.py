"""Static facts about one stack's buffers and table that the device ops need."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..preprocessing import coo_buffer_size_per_device, row_pointers_size_per_device
from ..specs import QuantizationConfig
from ..specs._weights_dtype import FLOAT32, is_half
from ..stacking import StackingPlan, round_up


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """Shapes of one stack on one device (hashable: used as a static jit argument).

    Attributes:
      name: the stack.
      num_devices: G, devices of the mesh axis the table is sharded over.
      sc_per_device: S, logical SparseCores per device.
      rows_per_shard: R, table rows of one partition's shard.
      samples_per_sc: samples each SparseCore holds (its block of the activations).
      pointers_per_sc: row pointers per SparseCore, max(N, 8).
      slot: COO entries per SparseCore.
      capacity: entries one SparseCore can send to one device (a contiguous window
        of its slot covering that device's partitions).
      dim: padded embedding width.
      quantization: simulated quantization of the looked-up rows, if any.
      minibatched: the buffers use the minibatched layout (`enable_minibatching`):
        `64·S` pointer blocks of `pointers_per_sc`, absolute pointers, segments
        packed back to back (see `_minibatching`).
      partition_span: `roundup8(max_ids_per_partition)`, the most entries (with
        alignment) one partition holds in one pass or one minibatch.
      weights_dtype: the table's storage format (float32, bfloat16 or float16).
    """

    name: str
    num_devices: int
    sc_per_device: int
    rows_per_shard: int
    samples_per_sc: int
    pointers_per_sc: int
    slot: int
    capacity: int
    dim: int
    quantization: QuantizationConfig | None = None
    minibatched: bool = False
    partition_span: int = 8
    weights_dtype: np.dtype = FLOAT32

    @property
    def half(self) -> bool:
        """The table is stored in a 16-bit format (rows written with stochastic rounding)."""
        return is_half(self.weights_dtype)

    @property
    def num_partitions(self) -> int:
        return self.num_devices * self.sc_per_device

    @property
    def rows_per_device(self) -> int:
        return self.sc_per_device * self.rows_per_shard


def stack_layouts(plan: StackingPlan) -> dict[str, StackLayout]:
    """The layout of every stack of `plan`, keyed by stack name."""
    topo = plan.topology
    n, s = topo.num_partitions, topo.sc_per_device
    layouts = {}
    for name, stack in plan.stacks.items():
        minibatched = plan.config.enable_minibatching
        slot = coo_buffer_size_per_device(stack, topo, enable_minibatching=minibatched) // s
        layouts[name] = StackLayout(
            name=name, num_devices=topo.global_devices, sc_per_device=s,
            rows_per_shard=stack.vocab_size // n,
            samples_per_sc=stack.total_sample_count // n,
            pointers_per_sc=row_pointers_size_per_device(topo) // s, slot=slot,
            capacity=min(slot, s * round_up(stack.max_ids_per_partition, 8)),
            dim=stack.embedding_dim, quantization=stack.quantization,
            minibatched=minibatched,
            partition_span=round_up(stack.max_ids_per_partition, 8),
            weights_dtype=stack.weights_dtype,
        )
    return layouts
