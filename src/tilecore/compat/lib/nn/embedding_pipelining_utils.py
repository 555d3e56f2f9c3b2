"""Reference-compatible pipelining (`jax_tpu_embedding.sparsecore.lib.nn.embedding_pipelining_utils`).

Port by changing the import::

    # from jax_tpu_embedding.sparsecore.lib.nn import embedding_pipelining_utils as ep_utils
    from tilecore.compat import embedding_pipelining_utils as ep_utils

A pipelined loop makes `get_pipeline_train_steps(n) = n + 2` calls of `step`;
call i runs the SC backward stage of step i−2, the SC forward stage of step i and
the TC stage of step i−1 (skipped with `fake_tc_step=not is_output_valid(i, n)`),
so activations lag the table updates by one step. The work is done by
`tilecore.pipelining.pipelined_step`. This module imports JAX and Flax, unlike
`tilecore.compat` itself, which does not import it.
"""

from ..._pipelining import get_default_sc_bwd_function as get_default_sc_bwd_function
from ..._pipelining import get_default_sc_fwd_function as get_default_sc_fwd_function
from ..._pipelining import get_initial_state as get_initial_state
from ..._pipelining import get_pipeline_state_sharding as get_pipeline_state_sharding
from ..._pipelining import get_pipeline_train_steps as get_pipeline_train_steps
from ..._pipelining import is_output_valid as is_output_valid
from ..._pipelining import step as step
from ..._pipelining_types import CurrentStepInput as CurrentStepInput
from ..._pipelining_types import LastStepInput as LastStepInput
from ..._pipelining_types import PipelineState as PipelineState
from ..._pipelining_types import ScBwdStageFun as ScBwdStageFun
from ..._pipelining_types import ScFwdStageFun as ScFwdStageFun
from ..._pipelining_types import StepBeforeLastStepInput as StepBeforeLastStepInput
from ..._pipelining_types import TcStageFun as TcStageFun

__all__ = [
    "CurrentStepInput",
    "LastStepInput",
    "PipelineState",
    "ScBwdStageFun",
    "ScFwdStageFun",
    "StepBeforeLastStepInput",
    "TcStageFun",
    "get_default_sc_bwd_function",
    "get_default_sc_fwd_function",
    "get_initial_state",
    "get_pipeline_state_sharding",
    "get_pipeline_train_steps",
    "is_output_valid",
    "step",
]
