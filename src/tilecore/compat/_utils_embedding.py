"""Small names of the reference's `embedding` module: initializer pairs, the sharding
strategy enum and the cross-host all-reduce handle.

`get_all_reduce_interface` does not open the reference's gRPC port: tilecore's
processes agree through JAX's distributed runtime, so the handle it returns is a
`tilecore.distributed.DistributedAgreement` (the `Agreement` that native
preprocessing takes).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ..distributed import DistributedAgreement

CallableTableInitializer = Callable[..., Any]


class EmbeddingVariablesInitializer(NamedTuple):
    """One initializer for a table and one per optimizer slot (the reference's pair)."""

    table: CallableTableInitializer
    slot: tuple[CallableTableInitializer, ...]


class ShardingStrategy(enum.IntEnum):
    """How table rows are spread over SparseCores; values as the reference's enum."""

    MOD = 1


def sharding_strategy_to_enum(sharding_strategy: str) -> ShardingStrategy:
    """`"MOD"` (any case) → `ShardingStrategy.MOD`; any other strategy raises ValueError."""
    if isinstance(sharding_strategy, str) and sharding_strategy.upper() == "MOD":
        return ShardingStrategy.MOD
    raise ValueError(
        f"Unsupported sharding strategy: {sharding_strategy!r}. Only MOD is supported; pass "
        "sharding_strategy='MOD'."
    )


def _check_int(name: str, value: Any, low: int, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"get_all_reduce_interface: {name} must be an integer {bound}, got "
                         f"{value!r}.")
    return value


def get_all_reduce_interface(
    peer_addresses: Sequence[str],
    minibatching_port: int,
    host_id: int | None = None,
    host_count: int | None = None,
) -> DistributedAgreement:
    """How this host agrees with its peers on each batch's minibatch split.

    Returns a `tilecore.distributed.DistributedAgreement` over JAX's distributed
    runtime (`jax.distributed.initialize(...)` must have run when `host_count` > 1),
    for `preprocess_sparse_dense_matmul_input(..., all_reduce_interface=...)`.
    `peer_addresses` and `minibatching_port` are checked and otherwise unused: no
    port is opened. `host_id`/`host_count` default to JAX's process index/count.
    Make one per training loop, in the same order on every host.
    """
    if isinstance(peer_addresses, str) or not all(isinstance(a, str) for a in peer_addresses):
        raise ValueError(
            "get_all_reduce_interface: peer_addresses must be a sequence of 'host:port' strings, "
            f"got {peer_addresses!r}."
        )
    if host_id is None or host_count is None:
        import jax

        host_id = jax.process_index() if host_id is None else host_id
        host_count = jax.process_count() if host_count is None else host_count
    from ..distributed import DistributedAgreement

    _check_int("minibatching_port", minibatching_port, 0, 65535)
    count = _check_int("host_count", host_count, 1, None)
    return DistributedAgreement(None, name="all_reduce_interface", process_count=count,
                                process_id=_check_int("host_id", host_id, 0, count - 1))
