"""Click sources for the input-worker tests (tests/test_train.py).

Imported inside `tilecore train --input-processes` workers, so this module must not
import JAX (the workers check that nothing did).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np

from tilecore import data


@dataclasses.dataclass(frozen=True)
class CheckedSource:
    """`base`'s batches; raises in a worker if JAX was imported there, or at `fail_at`.

    A worker is any process other than the one that made the source (`main_pid`).
    A worker dies at `crash_at` (exit status 7); batch `k` of `wide` has its dense
    features repeated `wide[k]` times (batches of another size, in every process);
    `eval_batch` raises if `fail_eval`.
    """

    base: data.ClickDataset
    fail_at: int | None = None
    sleep_s: float = 0.0
    crash_at: int | None = None
    wide: tuple[tuple[int, int], ...] = ()
    fail_eval: bool = False
    main_pid: int = dataclasses.field(default_factory=os.getpid)

    @property
    def features(self) -> tuple[data.ClickFeature, ...]:
        return self.base.features

    @property
    def num_dense(self) -> int:
        return self.base.num_dense

    @property
    def batch_size(self) -> int:
        return self.base.batch_size

    def train_batch(self, step: int) -> data.ClickBatch:
        if os.getpid() != self.main_pid and "jax" in sys.modules:
            raise AssertionError("the input worker imported jax")
        if step == self.fail_at:
            raise ValueError(f"bad batch {step}")
        if step == self.crash_at and os.getpid() != self.main_pid:
            os._exit(7)
        time.sleep(self.sleep_s)
        batch = self.base.train_batch(step)
        times = dict(self.wide).get(step, 1)
        return dataclasses.replace(batch, dense=np.repeat(batch.dense, times, axis=1))

    def eval_batch(self, index: int) -> data.ClickBatch:
        if self.fail_eval:
            raise RuntimeError("no held-out data")
        return self.base.eval_batch(index)
