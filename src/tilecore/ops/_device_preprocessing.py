"""Preprocessing on the device: the host copies flat IDs, a jitted program packs them.

`preprocess_on_device` returns what `tilecore.preprocess` returns for the same
inputs, bit for bit (buffers as JAX arrays on the default device), so limits,
statistics and training results do not depend on where a batch was packed.
`preprocess_batch` picks the side with one option, `preprocess_on`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import jax
import numpy as np

from ..preprocessing import (
    PreprocessedBatch,
    PreprocessStats,
    StackBuffers,
    preprocess,
    resolve_num_threads,
)
from ..preprocessing._flat import FlatFeature, explain_input_error, flatten
from ..preprocessing._layout import plan_layout
from ..preprocessing._preprocess import FeatureInput, check_counts
from ..stacking import StackingPlan
from ._device_packing import FeatureStatic, StackStatic, program

PreprocessOn = Literal["host", "device", "auto"]
"""Where batches are packed: `host` (`tilecore.preprocess`, numpy/numba), `device`
(`preprocess_on_device`), or `auto`: the side measured faster, today the host on every
backend (criteo26 on an NVIDIA H200 beside 16 Xeon cores: 35 ms host, 54 ms device per
batch of 65,536; 10.6 and 11.3 ms at 4,096). Ask for the device to spare the host's
cores for other work."""

_COUNTS = ("max_ids", "max_unique", "required", "dropped", "overflow", "bad")


def _statics(plan: StackingPlan, flat: Mapping[str, FlatFeature]) -> tuple[StackStatic, ...]:
    layout, topo = plan_layout(plan), plan.topology
    n, s = topo.num_partitions, topo.sc_per_device
    statics = []
    for name, stack in plan.stacks.items():
        if stack.vocab_size + n > 2**31 - 1:
            raise ValueError(
                f"Stack {name!r}: its {stack.vocab_size} rows do not fit the int32 IDs of "
                "device preprocessing. Preprocess it on the host (preprocess_on='host').")
        sl = layout.stack(plan, name)
        statics.append(StackStatic(
            features=tuple(FeatureStatic(
                rows_per_sc=f.rows_per_sc, sample_base=f.sample_base, shift=f.shift,
                col_offset=f.col_offset, vocab_size=f.feature.table.vocab_size,
                weighted=flat[f.feature.name].weights is not None) for f in sl.features),
            combiner=sl.combiner, num_partitions=n, sc_per_device=s,
            local_devices=topo.num_local_devices, slot=sl.slot,
            pointers=sl.buffers[0][0][1] // s, row_bits=sl.rowbits,
            sample_bits=max(1, (sl.samples_per_sc - 1).bit_length())))
    return tuple(statics)


def preprocess_on_device(
    plan: StackingPlan,
    inputs: Mapping[str, FeatureInput],
    weights: Mapping[str, Any] | None = None,
    *,
    has_leading_dimension: bool = True,
) -> tuple[PreprocessedBatch, PreprocessStats]:
    """`tilecore.preprocess`, computed on the default JAX device: bit-identical buffers
    (JAX arrays) and the same statistics, errors and warning.

    The host checks the inputs' structure and copies each feature's IDs (and
    weights) into one flat array of a capacity fixed per feature (`FlatFeature`),
    so a few compiled programs serve every batch; one jitted program then
    transforms, sorts, merges, counts, limits and packs every stack. Worth it where
    the host's cores are few or busy and the device has time to spare; on a GPU beside
    16 host cores it is not yet faster than the host (see `PreprocessOn`).

    A jitted program cannot raise, so the device returns its counts and one flag per
    stack for invalid IDs or weights; the host fetches them (a few hundred bytes,
    which waits for the program) and then raises or warns exactly as `preprocess`
    does: `LimitExceededError` and the buffer error from the same checks of the same
    counts, and for invalid inputs the host's own validation of them names the first
    one (run only when the flag is set).

    Minibatching is not done on the device: a plan with `enable_minibatching` raises
    ValueError (preprocess it on the host). Stacks must have fewer than 2³¹ rows.
    """
    flat = flatten(plan, inputs, weights)
    statics = _statics(plan, flat)
    layout = plan_layout(plan)
    names = [[f.name for f in layout.stack_features[name]] for name in plan.stacks]
    limits = tuple(np.array([s.max_ids_per_partition, s.max_unique_ids_per_partition], np.int32)
                   for s in plan.stacks.values())
    args = (limits, tuple(tuple(flat[f].ids for f in fs) for fs in names),
            tuple(tuple(flat[f].row_splits for f in fs) for fs in names),
            tuple(tuple(flat[f].weights for f in fs) for fs in names))
    with jax.enable_x64(True):
        out = program(statics, *args)
    counts = jax.device_get([{k: o[k] for k in _COUNTS} for o in out])
    if any(bool(c["bad"]) for c in counts):
        explain_input_error(plan, inputs, weights)

    def per_stack(key: str, convert: Any = lambda v: np.asarray(v, np.int32)) -> dict[str, Any]:
        return {name: convert(c[key]) for name, c in zip(plan.stacks, counts, strict=True)}

    stats = PreprocessStats(
        max_ids_per_partition=per_stack("max_ids"),
        max_unique_ids_per_partition=per_stack("max_unique"),
        required_buffer_size_per_sc=per_stack("required"),
        id_drop_counters=per_stack("dropped", int),
    )
    overflow = per_stack("overflow", int)
    check_counts(plan, stats, overflow, minibatched=False, stacklevel=3)
    stacks = {}
    for name, o in zip(plan.stacks, out, strict=True):
        buffers = {f.name: o[f.name] for f in dataclasses.fields(StackBuffers)}
        if not has_leading_dimension:
            buffers = {k: v.reshape(-1) for k, v in buffers.items()}
        stacks[name] = StackBuffers(**buffers)
    return PreprocessedBatch(stacks=stacks, made_for=layout.signature(plan)), stats


def resolve_preprocess_on(preprocess_on: PreprocessOn, plan: StackingPlan
                          ) -> Literal["host", "device"]:
    """The side `preprocess_on` means for `plan`: `auto` is the host (see `PreprocessOn`)."""
    if preprocess_on not in ("host", "device", "auto"):
        raise ValueError(
            f"preprocess_on must be 'host', 'device' or 'auto', got {preprocess_on!r}.")
    del plan  # the measured choice does not depend on it today
    return "host" if preprocess_on == "auto" else preprocess_on


def preprocess_batch(
    plan: StackingPlan,
    inputs: Mapping[str, FeatureInput],
    weights: Mapping[str, Any] | None = None,
    *,
    preprocess_on: PreprocessOn = "auto",
    num_threads: int | None = None,
) -> tuple[PreprocessedBatch, PreprocessStats]:
    """One batch packed where `preprocess_on` says (`resolve_preprocess_on`): the same
    result either way, numpy arrays from the host, JAX arrays from the device.
    `num_threads` is the host path's, checked on either (a program that runs both must
    not find its bad value only when it moves to the host)."""
    if num_threads is not None:
        resolve_num_threads(num_threads)
    if resolve_preprocess_on(preprocess_on, plan) == "device":
        return preprocess_on_device(plan, inputs, weights)
    return preprocess(plan, inputs, weights, num_threads=num_threads)
