"""Reference-style feature specs shared by the compat Flax and pipelining tests."""

from __future__ import annotations

import jax

from tilecore.compat import embedding, embedding_spec


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
