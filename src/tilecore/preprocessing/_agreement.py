"""How preprocessing agrees with its peer processes on one value per batch.

Minibatching needs every process to run the same number of minibatches, so
values are OR-reduced over all processes per batch: whether any partition
anywhere exceeds its limits (pass 1), the 63-bit split mask (pass 2), and then
whether any process failed to pack its minibatches (so all stop together). Host
code must not import JAX, so preprocessing only sees this protocol; the
implementation over JAX's distributed runtime lives in `tilecore.distributed`.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

Round = Literal["required", "split", "failed"]


@runtime_checkable
class Agreement(Protocol):
    """OR-reduces a 64-bit value over every process taking part in preprocessing."""

    @property
    def process_count(self) -> int:
        """How many processes take part (1 for a single process)."""
        ...

    def all_reduce_or(self, batch_number: int, round: Round, value: int) -> int:
        """The bitwise OR of `value` over all processes for this batch and round.

        Every process must call it with the same `batch_number` and `round`; an
        implementation raises (naming the processes and what differs) rather than
        hang when a peer is missing or disagrees.
        """
        ...


class LocalAgreement:
    """The single-process agreement: the value itself."""

    @property
    def process_count(self) -> int:
        return 1

    def all_reduce_or(self, batch_number: int, round: Round, value: int) -> int:
        del batch_number, round
        return int(value)
