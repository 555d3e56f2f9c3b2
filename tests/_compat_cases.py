"""Reference-style feature specs shared by the compat Flax and pipelining tests."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from tilecore.compat import embedding, embedding_spec
from tilecore.compat._device import buffers, matmul_input_parts
from tilecore.preprocessing import PreprocessedBatch
from tilecore.stacking import StackingPlan


def feature_specs(batch: int, sc: int) -> dict[str, embedding_spec.FeatureSpec]:
    """Two Adagrad tables (user: sum, dim 8; item: mean, dim 4), prepared for 1 device."""
    init = jax.nn.initializers.uniform(0.1)
    opt = embedding_spec.AdagradOptimizerSpec(learning_rate=0.3)
    user = embedding_spec.TableSpec(name="user", vocabulary_size=64, embedding_dim=8,
                                    initializer=init, optimizer=opt, combiner="sum")
    item = embedding_spec.TableSpec(name="item", vocabulary_size=96, embedding_dim=4,
                                    initializer=init, optimizer=opt, combiner="mean")
    specs = {
        "user": embedding_spec.FeatureSpec(name="user", table_spec=user, input_shape=[batch, 1],
                                           output_shape=[batch, 8]),
        "item": embedding_spec.FeatureSpec(name="item", table_spec=item, input_shape=[batch, 3],
                                           output_shape=[batch, 4]),
    }
    embedding.prepare_feature_specs_for_training(specs, global_device_count=1,
                                                 num_sc_per_device=sc)
    return specs


def native_batch(plan: StackingPlan, preprocessed: Any) -> PreprocessedBatch:
    """The native batch view of a reference `PreprocessedInput` (no copies), to compare
    the compat layers with `tilecore.ops` on the same buffers."""
    parts = matmul_input_parts(preprocessed)
    count = getattr(preprocessed, "num_minibatches", None)
    return PreprocessedBatch(stacks={name: buffers(parts, name) for name in plan.stacks},
                             num_minibatches=1 if count is None else int(
                                 np.asarray(count).reshape(-1)[0]))
