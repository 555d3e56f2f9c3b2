"""What can go wrong when reading a checkpoint, as exceptions that say how to fix it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path


class CheckpointNotFoundError(FileNotFoundError):
    """The directory holds no (finished) checkpoint, or not the step asked for."""


class CheckpointCorruptError(ValueError):
    """A checkpoint's metadata or arrays cannot be read back."""


class CheckpointTargetError(ValueError):
    """A restore target (`extra`) of another structure or other leaf shapes than what was
    saved: the checkpoint is intact, the model or state it is read into differs."""


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One difference between a checkpoint's tables and the model's.

    Attributes:
      table: the table's name.
      field: what differs: `table` (present on one side only), `vocab_size`,
        `embedding_dim` or `optimizer` (which decides the slot variables).
      saved: the checkpoint's value (None: the table is not in the checkpoint).
      expected: the model's value (None: the table is not in the model).
    """

    table: str
    field: str
    saved: object
    expected: object

    def __str__(self) -> str:
        if self.saved is None:
            return f"table {self.table!r}: in the model ({self.expected}) but not in the checkpoint"
        if self.expected is None:
            return f"table {self.table!r}: in the checkpoint ({self.saved}) but not in the model"
        return f"table {self.table!r}: {self.field} saved={self.saved}, expected={self.expected}"


class CheckpointMismatchError(ValueError):
    """The checkpoint's tables differ from the model's; lists every difference at once."""

    def __init__(self, path: Path, step: int, mismatches: Sequence[Mismatch]) -> None:
        self.path = path
        self.step = step
        self.mismatches = tuple(mismatches)
        lines = "\n".join(f"  - {m}" for m in self.mismatches)
        super().__init__(
            f"Checkpoint {str(path)!r} (step {step}) does not fit the model's tables; "
            f"{len(self.mismatches)} mismatch(es):\n{lines}\n"
            "Restore with the TableSpecs the checkpoint was saved with (they are listed in "
            "tilecore.checkpoint.read_metadata(path)['tables']), or read the saved tables "
            "with export_tables(path) and build new variables from them."
        )
