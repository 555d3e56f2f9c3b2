"""Multi-process runs: agreement between processes, and global arrays over all of them.

Imports JAX. After `jax.distributed.initialize(...)` every process preprocesses
its own rows (`local_inputs` / `process_rows`) with a plan whose Topology names
its `local_devices`, agrees with its peers per batch through
`DistributedAgreement` (minibatching's OR-reductions, FDO statistics), and turns
its buffers into global arrays (`global_batch`, `to_global`) that the device ops
run on over a mesh spanning every process. The processes agree on the plan before
the ops first run it (`agree_on_plan`) and fail together (`fail_together`).
"""

from ._agreement import DistributedAgreement as DistributedAgreement
from ._arrays import global_batch as global_batch
from ._arrays import local_inputs as local_inputs
from ._arrays import process_rows as process_rows
from ._arrays import to_global as to_global
from ._arrays import to_local as to_local
from ._exchange import KeyValueStore as KeyValueStore
from ._stats import max_over_processes as max_over_processes
from ._together import agree_on_plan as agree_on_plan
from ._together import fail_together as fail_together

__all__ = [
    "DistributedAgreement",
    "KeyValueStore",
    "agree_on_plan",
    "fail_together",
    "global_batch",
    "local_inputs",
    "max_over_processes",
    "process_rows",
    "to_global",
    "to_local",
]
