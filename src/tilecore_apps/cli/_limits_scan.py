"""What `tilecore limits` measures: per-stack statistics over many batches, and a report.

Host-side only (numpy and the preprocessing API; no JAX). "Minibatches needed" is
the seed's rule applied to the observed maxima — an estimate of what the current
limits would need, without preprocessing every batch again with minibatching on
(training with minibatching reports the actual per-step counts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

import tilecore as tc
from tilecore.stacking import memory_estimates

from .._common import preprocess_dropping


@dataclasses.dataclass(kw_only=True)
class StackScan:
    """One stack's statistics accumulated over the scanned batches.

    `max_ids`, `max_unique`: `[local_devices, N]` maxima over batches;
    `required_per_sc`: `[local_devices, S]` maxima; `load_sum`: the sum over batches
    of the per-partition `max_ids` (maximum over local devices), for the mean;
    `dropped`: ID occurrences the current limits drop (dropping allowed);
    `ids`: raw IDs of the stack's features, summed over batches.
    """

    max_ids: np.ndarray
    max_unique: np.ndarray
    required_per_sc: np.ndarray
    load_max: np.ndarray
    load_sum: np.ndarray
    dropped: int = 0
    ids: int = 0
    batches: int = 0


def minibatches_needed(observed: np.ndarray, limit: int) -> int:
    """Seed rule: 1 if nothing exceeds `limit`, else the smallest power of two
    k with ceil(observed / limit) <= k for every partition."""
    worst = int(np.max(observed, initial=0))
    ratio = -(-worst // max(limit, 1))
    return 1 if ratio <= 1 else 1 << math.ceil(math.log2(ratio))


def scan(
    plan: tc.StackingPlan,
    batches: Iterable[Mapping[str, tc.Ragged]],
    *,
    progress: Callable[[int], None] | None = None,
) -> dict[str, StackScan]:
    """Preprocess every batch under `plan` with dropping allowed; accumulate per stack."""
    out: dict[str, StackScan] = {}
    for i, batch in enumerate(batches):
        _, stats = preprocess_dropping(plan, batch, num_threads=None)
        for name, stack in plan.stacks.items():
            ids = stats.max_ids_per_partition[name]
            load = ids.max(axis=0)
            num_ids = sum(len(batch[f].values) for f in stack.feature_names)
            if name not in out:
                out[name] = StackScan(
                    max_ids=ids.copy(), max_unique=stats.max_unique_ids_per_partition[name].copy(),
                    required_per_sc=stats.required_buffer_size_per_sc[name].copy(),
                    load_max=load.copy(), load_sum=load.astype(np.float64),
                )
            else:
                s = out[name]
                np.maximum(s.max_ids, ids, out=s.max_ids)
                np.maximum(s.max_unique, stats.max_unique_ids_per_partition[name],
                           out=s.max_unique)
                np.maximum(s.required_per_sc, stats.required_buffer_size_per_sc[name],
                           out=s.required_per_sc)
                np.maximum(s.load_max, load, out=s.load_max)
                s.load_sum += load
            out[name].dropped += int(stats.id_drop_counters[name])
            out[name].ids += num_ids
            out[name].batches += 1
        if progress is not None:
            progress(i + 1)
    if not out:
        raise ValueError("limits: no batches to scan; pass --batches >= 1.")
    return out


def _limits(stack: tc.StackSpec, topology: tc.Topology, memory: Any) -> dict[str, Any]:
    return {
        "max_ids_per_partition": stack.max_ids_per_partition,
        "max_unique_ids_per_partition": stack.max_unique_ids_per_partition,
        "suggested_coo_buffer_size_per_device": stack.suggested_coo_buffer_size_per_device,
        "coo_buffer_size_per_device": tc.coo_buffer_size_per_device(stack, topology),
        "forward_hbm_stack_bytes": memory.forward_hbm_stack_bytes,
        "backward_hbm_stack_bytes": memory.backward_hbm_stack_bytes,
    }


def report(plan: tc.StackingPlan, scans: Mapping[str, StackScan]) -> dict[str, Any]:
    """The numbers of one topology: per stack observed, current and recommended limits."""
    stats = tc.PreprocessStats(
        max_ids_per_partition={n: s.max_ids for n, s in scans.items()},
        max_unique_ids_per_partition={n: s.max_unique for n, s in scans.items()},
        required_buffer_size_per_sc={n: s.required_per_sc for n, s in scans.items()},
        id_drop_counters={n: s.dropped for n, s in scans.items()},
    )
    recommended = tc.update_preprocessing_parameters(plan, stats)
    topology = plan.topology
    current_mem, rec_mem = memory_estimates(plan), memory_estimates(recommended)
    stacks = {}
    for name, s in scans.items():
        stack = plan.stacks[name]
        k = max(minibatches_needed(s.max_ids, stack.max_ids_per_partition),
                minibatches_needed(s.max_unique, stack.max_unique_ids_per_partition))
        stacks[name] = {
            "tables": list(stack.table_names),
            "features": list(stack.feature_names),
            "observed": {
                "max_ids_per_partition": int(s.max_ids.max(initial=0)),
                "max_unique_ids_per_partition": int(s.max_unique.max(initial=0)),
                "required_buffer_size_per_sc": int(s.required_per_sc.max(initial=0)),
            },
            "current": _limits(stack, topology, current_mem[name]),
            "recommended": _limits(recommended.stacks[name], topology, rec_mem[name]),
            "table_bytes": current_mem[name].table_bytes,
            "padding_overhead": current_mem[name].padding_overhead,
            "minibatches_needed_estimate": k,
            "dropped_ids": s.dropped,
            "ids": s.ids,
            "per_partition_max_ids": {"max": s.load_max.tolist(),
                                      "mean": (s.load_sum / max(s.batches, 1)).tolist()},
        }
    return {
        "topology": str(topology),
        "num_partitions": plan.num_partitions,
        "minibatches_needed_estimate": max(
            (v["minibatches_needed_estimate"] for v in stacks.values()), default=1),
        "dropped_ids": sum(v["dropped_ids"] for v in stacks.values()),
        "stacks": stacks,
    }
