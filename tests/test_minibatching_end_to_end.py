"""Host minibatching feeding the device loop: the result equals one unlimited pass.

Inputs are skewed enough, and limits tight enough (one hash bucket's load per
partition), that preprocessing must split every batch into at least five
minibatches. Activations, and tables and slots after the fused update, must
then equal a single pass with limits large enough for the whole batch, on both
the numba-kernel and the pure-XLA paths.
"""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilecore as tc
from tilecore import ops
from tilecore.testing import bucket_maxima, preprocess_reference


def _case(seed: int, sc: int, optimizer: tc.OptimizerSpec
          ) -> tuple[tc.StackingPlan, tc.StackingPlan, dict, dict]:
    """(minibatched plan with tight limits, single-pass plan, inputs, weights)."""
    rng = np.random.default_rng(seed)
    batch = 32 * sc
    tables = [tc.TableSpec(name=f"t{i}", vocab_size=int(v), embedding_dim=8,
                           optimizer=optimizer, combiner=c,
                           max_ids_per_partition=4096, max_unique_ids_per_partition=4096)
              for i, (v, c) in enumerate(zip(rng.integers(300, 2000, 2), ("sum", "mean"),
                                             strict=True))]
    features = [tc.FeatureSpec(name=f"f{i}", table=t, input_shape=(batch, 6),
                               output_shape=(batch, 8)) for i, t in enumerate(tables)]
    topology = tc.Topology(global_devices=1, sc_per_device=sc)
    single = tc.stack_tables(features, topology)
    inputs = {f.name: rng.integers(0, f.table.vocab_size, (batch, 6)) for f in features}
    weights = {f.name: rng.uniform(0.5, 2.0, (batch, 6)).astype(np.float32) for f in features}
    tight = single.with_config(enable_minibatching=True)
    reference = preprocess_reference(single, inputs, weights)
    for name in tight.stacks:
        max_ids, max_unique = bucket_maxima(reference.stacks[name].merged,
                                            topology.num_partitions)
        tight = tight.with_stack_limits(name, max_ids_per_partition=max_ids,
                                        max_unique_ids_per_partition=max_unique)
    return tight, single, inputs, weights


# The kernel choice (the fixture) holds for every example.
@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), sc=st.sampled_from([1, 2]),
       optimizer=st.sampled_from([tc.SGD(learning_rate=0.5), tc.Adagrad(learning_rate=0.3)]))
def test_minibatched_training_equals_single_pass(kernels: str, seed: int, sc: int,
                                                 optimizer: tc.OptimizerSpec) -> None:
    tight, single, inputs, weights = _case(seed, sc, optimizer)
    minibatched, stats = tc.preprocess(tight, inputs, weights)
    whole, _ = tc.preprocess(single, inputs, weights)
    assert minibatched.num_minibatches >= 5, minibatched.num_minibatches
    assert whole.num_minibatches == 1 and stats.dropped_ids == 0

    variables = ops.init_tables(single, jax.random.key(seed % 1000), on_host=True)
    want = ops.lookup(single, whole, variables)
    got = ops.lookup(tight, minibatched, variables)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)

    rng = np.random.default_rng(seed + 1)
    grads = {name: rng.standard_normal(a.shape).astype(np.float32) for name, a in want.items()}
    want_vars = ops.lookup_grad(single, whole, variables, grads, 3)
    got_vars = ops.lookup_grad(tight, minibatched, variables, grads, 3)
    for name, expected in want_vars.items():
        np.testing.assert_allclose(got_vars[name].table, expected.table, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} table ({kernels})")
        for i, slot in enumerate(expected.slots):
            np.testing.assert_allclose(got_vars[name].slots[i], slot, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} slot {i} ({kernels})")
