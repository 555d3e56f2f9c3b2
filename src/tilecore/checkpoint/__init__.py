"""Checkpoints through Orbax, and conversion between topologies.

`save` writes every stack's table and optimizer slots, the specs and stacking
plan (as JSON) and any extra pytree (dense parameters, optax state) in one
atomic step; `restore` reads them back for any plan, converting the layout when
the number of devices, SparseCores per device or the stacking changed.
`unshard_variables` / `shard_variables` do that conversion in memory;
`export_tables` gives plain per-table arrays for serving.

Every checkpoint records a checksum of each array; reads compare them, so damaged
files raise `CheckpointCorruptError` (naming the step and array) instead of
restoring other values, and `verify` checks a checkpoint without restoring it.
"""

from ._convert import TableState as TableState
from ._convert import shard_variables as shard_variables
from ._convert import unshard_variables as unshard_variables
from ._errors import CheckpointCorruptError as CheckpointCorruptError
from ._errors import CheckpointMismatchError as CheckpointMismatchError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CheckpointTargetError as CheckpointTargetError
from ._errors import Mismatch as Mismatch
from ._export import export_tables as export_tables
from ._export import read_metadata as read_metadata
from ._save_restore import Checkpoint as Checkpoint
from ._save_restore import restore as restore
from ._save_restore import save as save
from ._save_restore import verify as verify
from ._store import available_steps as available_steps

__all__ = [
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointTargetError",
    "Mismatch",
    "TableState",
    "available_steps",
    "export_tables",
    "read_metadata",
    "restore",
    "save",
    "shard_variables",
    "unshard_variables",
    "verify",
]
