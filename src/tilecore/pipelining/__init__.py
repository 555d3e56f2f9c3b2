"""Training steps: SparseCore and TensorCore work pipelined across steps, or in sequence.

A step has three stages (`Stages`): SC forward (lookup), TC (dense forward,
backward and optimizer), SC backward (fused table update). The pipelined step
runs, in call i, the SC backward of step i−2, the SC forward of step i and the
TC stage of step i−1, so the two kinds of work overlap, at the price of one step
of table staleness; n steps take `pipeline_steps(n) = n + 2` calls. The plain
step runs the three stages of one step in order. Both share one calling
convention (`TrainStep`, `run_loop`), so a loop switches with one flag.

```
stages = sparsecore_stages(plan, optax_tc(loss_fn, optax.sgd(0.1)))
step = TrainStep(stages=stages, pipelined=True)
state = step.init(variables, DenseState.create(params, optax.sgd(0.1)), first_batch)
for result in (run := run_loop(step, state, batches)):
    print(result.step, result.outputs)
tables = run.state.variables
```
"""

from ._loop import StepResult as StepResult
from ._loop import TrainingRun as TrainingRun
from ._loop import run_loop as run_loop
from ._sharding import pipeline_state_sharding as pipeline_state_sharding
from ._sharding import train_state_sharding as train_state_sharding
from ._stages import DenseState as DenseState
from ._stages import optax_tc as optax_tc
from ._stages import sparsecore_stages as sparsecore_stages
from ._state import LastStepInput as LastStepInput
from ._state import PipelineState as PipelineState
from ._state import StepBeforeLastStepInput as StepBeforeLastStepInput
from ._state import TrainState as TrainState
from ._state import empty_batch as empty_batch
from ._state import is_output_valid as is_output_valid
from ._state import pipeline_steps as pipeline_steps
from ._state import placeholder_input as placeholder_input
from ._step import initial_state as initial_state
from ._step import pipelined_step as pipelined_step
from ._step import plain_step as plain_step
from ._train_step import TrainStep as TrainStep
from ._types import Stages as Stages
from ._types import StepInput as StepInput
from ._types import StepOutput as StepOutput
from ._types import TcResult as TcResult

__all__ = [
    "DenseState",
    "LastStepInput",
    "PipelineState",
    "Stages",
    "StepBeforeLastStepInput",
    "StepInput",
    "StepOutput",
    "StepResult",
    "TcResult",
    "TrainState",
    "TrainStep",
    "TrainingRun",
    "empty_batch",
    "initial_state",
    "is_output_valid",
    "optax_tc",
    "pipeline_state_sharding",
    "pipeline_steps",
    "pipelined_step",
    "placeholder_input",
    "plain_step",
    "run_loop",
    "sparsecore_stages",
    "train_state_sharding",
]
