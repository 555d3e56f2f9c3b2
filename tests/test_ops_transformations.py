"""JAX's transformations over the device ops, on both wings (numba CPU kernels and XLA).

The CPU kernels are FFI calls, which JAX can neither differentiate nor vmap by itself:
`jax.grad`/`jvp` of a lookup with respect to the tables, `jax.vmap` of the ops, and
`jax.grad` through `embed` with respect to the variables (documented: no gradient for
them) each failed on one wing or both with JAX-internal errors. Each must give what the
numpy oracle (or a Python loop) gives, on either wing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
from tilecore import ops

VOCAB, DIM, BATCH, IDS = 37, 5, 8, 2


@pytest.fixture(scope="module")
def case() -> tuple[tc.StackingPlan, tc.PreprocessedBatch, np.ndarray, np.ndarray]:
    table = tc.TableSpec(name="a", vocab_size=VOCAB, embedding_dim=DIM,
                         optimizer=tc.SGD(learning_rate=0.5))
    plan = tc.plan_stacking([tc.FeatureSpec(name="f", table=table, input_shape=(BATCH, IDS))],
                            tc.Topology(global_devices=1, sc_per_device=2))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, IDS))
    values = rng.standard_normal((VOCAB, DIM)).astype(np.float32)
    return plan, tc.preprocess(plan, {"f": ids})[0], ids, values


def _tables(plan: tc.StackingPlan, values: np.ndarray) -> dict[str, jax.Array]:
    return {"a": jnp.asarray(ops.shard(plan, {"a": values})["a"])}


def _pooled(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The sum combiner's activations, per sample (each ID once: preprocessing merges a
    sample's duplicates into one entry of their summed gain, the same sum)."""
    return values[ids].sum(1)


def test_grad_and_jvp_of_lookup_wrt_tables(case, kernels: str) -> None:
    plan, batch, ids, values = case
    tables = _tables(plan, values)

    def loss(tables: dict[str, jax.Array]) -> jax.Array:
        return (ops.lookup(plan, batch, tables)["f"] ** 2).sum()

    want = np.zeros_like(values)
    np.add.at(want, ids.ravel(), np.repeat(2 * _pooled(ids, values), IDS, axis=0))
    # Under jit, as a training step runs (eagerly, each op of XLA's tangent would be
    # compiled on its own: seconds for nothing the test needs).
    for grad in (jax.jit(jax.grad(loss)), jax.jit(jax.grad(jax.checkpoint(loss)))):
        got = ops.unshard(plan, grad(tables))["a"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    direction = np.random.default_rng(1).standard_normal(values.shape).astype(np.float32)
    primal, tangent = jax.jit(lambda t, d: jax.jvp(lambda t: ops.lookup(plan, batch, t)["f"],
                                                   (t,), (d,)))(tables, _tables(plan, direction))
    np.testing.assert_allclose(primal, _pooled(ids, values), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tangent, _pooled(ids, direction), rtol=1e-5, atol=1e-5)


def test_vmap_of_lookup_and_lookup_grad(case, kernels: str) -> None:
    plan, batch, ids, values = case
    tables = _tables(plan, values)
    other = tc.preprocess(plan, {"f": (ids + 3) % VOCAB})[0]
    both = jax.tree.map(lambda *x: jnp.stack(x), batch, other)
    out = jax.jit(jax.vmap(lambda b: ops.lookup(plan, b, tables)["f"]))(both)
    np.testing.assert_allclose(out[0], _pooled(ids, values), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1], _pooled((ids + 3) % VOCAB, values), rtol=1e-5, atol=1e-5)
    variables = {"a": ops.EmbeddingVariables(tables["a"])}
    grads = {"f": jnp.ones((BATCH, DIM), jnp.float32)}
    mapped = jax.jit(jax.vmap(lambda b: ops.lookup_grad(plan, b, variables, grads)["a"].table)
                     )(both)
    for k, b in enumerate((batch, other)):
        np.testing.assert_array_equal(mapped[k], ops.lookup_grad(plan, b, variables, grads)["a"].table)


def test_embed_gives_the_variables_no_gradient(case, kernels: str) -> None:
    """Differentiating through `embed` with respect to everything (as `jax.grad` over all
    of a Flax model's variables does): zeros for the tables, the activation gradients
    for the probe."""
    plan, batch, ids, values = case
    variables = {"a": ops.EmbeddingVariables(_tables(plan, values)["a"])}

    def loss(variables, probe):
        return (ops.embed(plan, batch, variables, probe)["f"] ** 2).sum()

    g_vars, g_probe = jax.grad(loss, argnums=(0, 1))(variables, ops.activation_probe(plan))
    assert not np.any(np.asarray(g_vars["a"].table))
    np.testing.assert_allclose(g_probe["f"], 2 * _pooled(ids, values), rtol=1e-5, atol=1e-5)


def test_numpy_tables_under_disable_jit(case, kernels: str) -> None:
    """XLA's kernels updated a numpy table with `.at[]` under `jax.disable_jit()`."""
    plan, batch, ids, values = case
    tables = {"a": np.asarray(_tables(plan, values)["a"])}
    grads = {"f": np.ones((BATCH, DIM), np.float32)}
    want = ops.lookup_grad(plan, batch, {"a": ops.EmbeddingVariables(tables["a"])}, grads)
    with jax.disable_jit():
        np.testing.assert_allclose(ops.lookup(plan, batch, tables)["f"], _pooled(ids, values),
                                   rtol=1e-5, atol=1e-5)
        got = ops.lookup_grad(plan, batch, {"a": ops.EmbeddingVariables(tables["a"])}, grads)
    np.testing.assert_allclose(got["a"].table, want["a"].table, rtol=1e-6, atol=1e-6)


def test_a_rule_that_reduces_over_rows_is_refused(case, kernels: str) -> None:
    """A CustomOptimizer rule summing over the whole block (not along each row) made
    every row's update depend on the batch's other rows, and on the CPU wing on
    uninitialised padding (other tables from one process to the next)."""
    _, _, ids, _ = case
    spec = tc.CustomOptimizer(
        update_fn=lambda g, r, s, lr: (r - lr * g / (1 + jnp.abs(g).sum()), s + g),
        learning_rate=0.1, slot_initial_value_tuple=(0.0,), name="block_sum")
    table = tc.TableSpec(name="a", vocab_size=VOCAB, embedding_dim=DIM, optimizer=spec)
    plan = tc.plan_stacking([tc.FeatureSpec(name="f", table=table, input_shape=(BATCH, IDS))],
                            tc.Topology(global_devices=1, sc_per_device=2))
    batch = tc.preprocess(plan, {"f": ids})[0]
    variables = ops.init_tables(plan, jax.random.key(0))
    with pytest.raises(ValueError, match=r"'block_sum' update rule is not row-wise"):
        ops.lookup_grad(plan, batch, variables, {"f": jnp.ones((BATCH, DIM), jnp.float32)})
