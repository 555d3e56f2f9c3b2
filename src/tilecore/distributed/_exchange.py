"""All-gather of small strings through JAX's distributed key-value store.

Every process that took part in `jax.distributed.initialize` can read and write
the coordination service's key-value store; that is all the networking this
needs. Call k of every process publishes its string under `<namespace>/k/<process>`
and blocks until it has read every peer's string of call k (or the deadline
passes). Completing call k proves every peer has finished call k-1 (a peer
publishes k only after reading all of k-1), so each process then deletes its own
key of call k-1: the store holds at most two keys per process and namespace.
"""

from __future__ import annotations

import time
from typing import Protocol


class KeyValueStore(Protocol):
    """The part of JAX's `DistributedRuntimeClient` an exchange uses."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...

    def key_value_delete(self, key: str) -> None: ...


def jax_store() -> KeyValueStore | None:
    """JAX's distributed client, or None before `jax.distributed.initialize`."""
    from jax._src import distributed

    return distributed.global_state.client


def _is_deadline(error: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(error)


class Exchange:
    """Numbered all-gathers of one string per process under one key namespace."""

    def __init__(self, store: KeyValueStore, namespace: str, process_id: int,
                 process_count: int, timeout_s: float, owner: str) -> None:
        self._store = store
        self._namespace = namespace
        self._process_id = process_id
        self._process_count = process_count
        self._timeout_s = timeout_s
        self._owner = owner
        self._calls = 0

    def _key(self, call: int, process: int) -> str:
        return f"{self._namespace}/{call}/{process}"

    def all_gather(self, payload: str, what: str) -> list[str]:
        """Every process's `payload` of this call, in process order.

        Raises:
          TimeoutError: some peers published nothing within the timeout; names them.
          RuntimeError: the distributed runtime failed (e.g. the coordinator exited).
        """
        call, me = self._calls, self._process_id
        self._calls += 1
        try:
            self._store.key_value_set(self._key(call, me), payload)
        except Exception as error:
            raise RuntimeError(
                f"{self._owner}: process {me} could not publish its value for {what} under "
                f"{self._key(call, me)!r}: {error}. If the key already exists, another "
                "DistributedAgreement uses the same name: give each one its own `name`."
            ) from error
        values = self._collect(call, payload, what)
        if call > 0:
            self._store.key_value_delete(self._key(call - 1, me))
        return values

    def _collect(self, call: int, own: str, what: str) -> list[str]:
        deadline = time.monotonic() + self._timeout_s
        found = {self._process_id: own}
        for peer in range(self._process_count):
            if peer in found:
                continue
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                break
            try:
                found[peer] = self._store.blocking_key_value_get(self._key(call, peer),
                                                                 remaining_ms)
            except Exception as error:
                if not _is_deadline(error):
                    raise RuntimeError(
                        f"{self._owner}: process {self._process_id} lost the distributed "
                        f"runtime while waiting for process {peer} at {what}: {error}"
                    ) from error
                break
        if len(found) < self._process_count:  # one last look, then name who is missing
            prefix = f"{self._namespace}/{call}/"
            for key, value in self._store.key_value_dir_get(prefix):
                found.setdefault(int(key.rsplit("/", 1)[-1]), value)
        missing = [p for p in range(self._process_count) if p not in found]
        if missing:
            raise TimeoutError(
                f"{self._owner}: processes {missing} did not reach {what} within "
                f"{self._timeout_s:g} s (process {self._process_id} waited; processes "
                f"{sorted(found)} arrived). A missing process has probably exited or is "
                "stuck: check its logs, or raise timeout_s if it is merely slow."
            )
        return [found[p] for p in range(self._process_count)]
