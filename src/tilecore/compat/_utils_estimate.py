"""Closed-form first guesses for the preprocessing limits (`utils.estimate_preprocessing_parameters`).

The reference's calibration, on Zipf-like traffic: one SparseCore's busiest
partition gets a `hot_shard_fraction` share of that SparseCore's lookups, plus
its even share of the rest, plus two standard deviations of a Poisson tail.
With `L` the lookups one SparseCore sends (`batch / (devices·S) · valency`) and
`P = devices·S` partitions, the peak is

    peak = headroom · (h·L + (1 − h)·L / P + 2·sqrt(L / P))

`max_ids_per_partition = roundup8(peak)`, `max_unique_ids_per_partition =
roundup8(peak / 2)`, and the COO buffer per device is the larger of `S` full
partitions and `1.2 · device lookups + 14·P`, rounded up to `8·S`.
"""

from __future__ import annotations

import math


def _ceil_to(value: float, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def _check_positive(**values: float) -> None:
    bad = {name: value for name, value in values.items()
           if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0}
    if bad:
        raise ValueError(
            "global_batch_size, global_device_count, num_sc_per_device, and valency must all "
            f"be positive numbers; got {bad}."
        )


def estimate(
    global_batch_size: int,
    global_device_count: int,
    num_sc_per_device: int,
    valency: float,
    hot_shard_fraction: float,
    headroom_factor: float,
) -> dict[str, int]:
    """The three limits, keyed as the reference names them (see the module docstring)."""
    _check_positive(global_batch_size=global_batch_size, global_device_count=global_device_count,
                    num_sc_per_device=num_sc_per_device, valency=valency)
    if not (0.0 <= hot_shard_fraction <= 1.0 and 0.0 < headroom_factor < math.inf):
        raise ValueError(
            f"hot_shard_fraction must lie in [0, 1] and headroom_factor be finite and > 0; got "
            f"hot_shard_fraction={hot_shard_fraction!r}, headroom_factor={headroom_factor!r}."
        )
    device_batch = global_batch_size // global_device_count
    sc_lookups = (device_batch // num_sc_per_device) * valency
    partitions = global_device_count * num_sc_per_device
    peak = headroom_factor * (
        hot_shard_fraction * sc_lookups
        + (1.0 - hot_shard_fraction) * sc_lookups / partitions
        + 2.0 * math.sqrt(sc_lookups / partitions)
    )
    max_ids = _ceil_to(peak, 8)
    device_buffer = max(num_sc_per_device * max_ids,
                        1.2 * device_batch * valency + 14 * partitions)
    return {
        "max_ids_per_partition": max_ids,
        "max_unique_ids_per_partition": _ceil_to(0.5 * peak, 8),
        "suggested_coo_buffer_size_per_device": _ceil_to(device_buffer, 8 * num_sc_per_device),
    }
