"""`DistributedAgreement`: the preprocessing `Agreement` over JAX's distributed runtime."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from typing import Any

from ..preprocessing import LocalAgreement
from ..preprocessing._agreement import Round
from ..stacking import StackingPlan
from ._exchange import Exchange, KeyValueStore, jax_store
from ._fingerprint import digest, leaf_differences, plan_items

_MAX_VALUE = 1 << 64
_instances: defaultdict[tuple[KeyValueStore, str, int], itertools.count] = defaultdict(
    itertools.count)
"""(store, name, process) → agreements made so far: numbers each agreement's keys. Keyed by
the store object itself (identity hash, held alive): a key by `id(store)` let a new store at
a freed store's address inherit its counts, so processes of one job disagreed on the keys."""


class DistributedAgreement:
    """OR-reduces preprocessing's per-batch values over every JAX process.

    Build one per training loop after `jax.distributed.initialize(...)`, on every
    process, with the same plan; pass it to `preprocess`. Construction checks that
    all processes hold the same plan (tables, features, stacks, limits, topology,
    config) and raises `ValueError` naming the processes and the fields that differ.
    Every call then publishes `(batch_number, round, value)` in the runtime's
    key-value store and reads everyone's: a peer at another batch or round raises
    `ValueError` naming both; a peer that never arrives raises `TimeoutError`
    naming it after `timeout_s` (never a hang). With one process nothing is
    exchanged.

    Every process must make the same calls in the same order, and create its
    agreements in the same order (an agreement's keys are numbered by how many
    of that `name` this process made before).

    Args:
      plan: the stacking plan every process preprocesses with (None: not checked,
        for agreements made before any plan exists, e.g. by
        `tilecore.compat.embedding.get_all_reduce_interface`).
      timeout_s: how long one call waits for its peers.
      name: keeps the keys of agreements that live at the same time apart.
      store, process_id, process_count: the key-value store and this process's
        place; default JAX's distributed client, `jax.process_index()` and
        `jax.process_count()` (tests pass an in-memory store).
    """

    def __init__(self, plan: StackingPlan | None, *, timeout_s: float = 300.0,
                 name: str = "default", store: KeyValueStore | None = None, process_id: int | None = None,
                 process_count: int | None = None) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"DistributedAgreement: timeout_s must be > 0, got {timeout_s!r}.")
        if process_id is None or process_count is None:
            import jax

            process_id = jax.process_index() if process_id is None else process_id
            process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= process_id < process_count:
            raise ValueError(
                f"DistributedAgreement: process_id must lie in [0, {process_count}), got "
                f"{process_id}.")
        self._name, self._process_id, self._process_count = name, process_id, process_count
        self._exchange: Exchange | None = None
        if process_count > 1:
            store = store if store is not None else jax_store()
            if store is None:
                raise RuntimeError(
                    f"DistributedAgreement: {process_count} processes but JAX's distributed "
                    "runtime is not initialized. Call jax.distributed.initialize(...) first.")
            instance = next(_instances[store, name, process_id])
            namespace = f"tilecore/agreement/{name}/{instance}"
            self._exchange = Exchange(store, namespace, process_id, process_count, timeout_s,
                                      f"DistributedAgreement {name!r}")
            if plan is not None:
                self.check_items(plan_items(plan), "plans")
        if plan is not None and plan.topology.num_processes != process_count:
            raise ValueError(
                f"DistributedAgreement: the plan's topology {plan.topology} has "
                f"{plan.topology.num_processes} processes (global_devices ÷ local_devices) but "
                f"{process_count} take part. Build the Topology with local_devices="
                f"{plan.topology.global_devices // process_count}.")

    @property
    def process_count(self) -> int:
        """How many processes take part."""
        return self._process_count

    @property
    def process_id(self) -> int:
        """This process's index among them."""
        return self._process_id

    def all_reduce_or(self, batch_number: int, round: Round, value: int) -> int:
        """The bitwise OR of `value` (an unsigned 64-bit integer) over all processes."""
        if isinstance(value, bool) or not 0 <= int(value) < _MAX_VALUE:
            raise ValueError(f"all_reduce_or: value must be an unsigned 64-bit integer, got "
                             f"{value!r} (batch {batch_number}, round {round!r}).")
        if self._exchange is None:
            return LocalAgreement().all_reduce_or(batch_number, round, value)
        result = 0
        for other in self.all_gather(batch_number, round, str(int(value))):
            result |= int(other)
        return result

    def all_gather(self, batch_number: int, round: str, value: Any) -> list[Any]:
        """Every process's JSON-able `value` for this batch and round, in process order.

        Raises `ValueError` if a peer is at another batch or round.
        """
        where = {"batch": int(batch_number), "round": str(round)}
        if self._exchange is None:
            return [value]
        what = (f"round {round!r}" if batch_number < 0  # a check outside the batches
                else f"batch {batch_number}, round {round!r}")
        texts = self._exchange.all_gather(json.dumps({**where, "value": value}), what)
        payloads = [json.loads(text) for text in texts]
        lagging = [(p, x) for p, x in enumerate(payloads)
                   if {k: x[k] for k in where} != where]
        if lagging:
            theirs = ", ".join(f"process {p} is at batch {x['batch']}, round {x['round']!r}"
                               for p, x in lagging)
            raise ValueError(
                f"DistributedAgreement {self._name!r}: process {self._process_id} is at {what} "
                f"but {theirs}. Every process must preprocess the same batches in the same "
                "order with the same batch_number.")
        return [x["value"] for x in payloads]

    def check_items(self, items: dict[str, Any], what: str,
                    remedy: str = "Build the plan from the same specs, topology, config and "
                                  "hyperparameters on every process") -> None:
        """Raise `ValueError` on every process unless all hold equal `items` (label →
        canonical value), naming the processes and leaves that differ, and `remedy`."""
        digests = self.all_gather(-1, what, {k: digest(v) for k, v in items.items()})
        labels = sorted({k for d in digests for k in d})
        differing = [k for k in labels if len({d.get(k) for d in digests}) > 1]
        if not differing:
            return
        # Everyone saw the same digests, so everyone takes this second, detailed round.
        details = self.all_gather(-1, f"{what} (details)", {k: items.get(k) for k in differing})
        lines = []
        for p, theirs in enumerate(details[1:], start=1):
            for label in differing:
                for diff in leaf_differences(theirs[label], details[0][label]):
                    lines.append(f"  process {p} vs process 0, {label}: {diff}")
        shown = "\n".join(lines[:20]) + ("\n  ..." if len(lines) > 20 else "")
        raise ValueError(
            f"DistributedAgreement {self._name!r}: processes hold different {what} "
            f"(differing: {', '.join(differing)}). {remedy}:\n{shown}")
