"""Hostile cases at the plan ↔ batch ↔ tables ↔ mesh boundary of the device ops.

Each mistake a user makes when wiring the stages together (a batch preprocessed for
another plan, tables of another plan, gradients of another shape, a mesh that is
not the plan's) must end in one clear error that names the stack and the mismatch,
raised while tracing, before any kernel runs; with both wings (numba CPU kernels
and plain XLA). Batches built by hand carry no signature: their buffers are still
measured against the layout, and entries that address rows or samples outside
their shard are skipped by the kernels, never read or written out of bounds. Those
cases run in a subprocess, where a crash would show as a signal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
from tilecore import distributed, ops


def make_plan(batch: int = 64, vocab: int = 1000, dim: int = 16, devices: int = 1,
              minibatching: bool = False, max_ids: int = 256) -> tc.StackingPlan:
    items = tc.TableSpec(name="items", vocab_size=vocab, embedding_dim=dim, combiner="mean",
                         optimizer=tc.Adagrad(learning_rate=0.5),
                         max_ids_per_partition=max_ids)
    features = [tc.FeatureSpec(name="clicked", table=items, input_shape=(batch, 1)),
                tc.FeatureSpec(name="history", table=items, input_shape=(batch, 4))]
    return tc.plan_stacking(features, tc.Topology(global_devices=devices, sc_per_device=4),
                            tc.SparseCoreConfig(enable_minibatching=minibatching))


def make_batch(plan: tc.StackingPlan, seed: int = 0) -> tc.PreprocessedBatch:
    batch = plan.features["clicked"].input_shape[0]
    vocab = plan.tables["items"].vocab_size
    rng = np.random.default_rng(seed)
    ids = {"clicked": rng.integers(0, vocab, (batch, 1)),
           "history": rng.integers(0, vocab, (batch, 4))}
    return tc.preprocess(plan, ids)[0]


PLAN = make_plan()
OTHER_PLANS = {
    "batch size": (make_plan(batch=128), r"'clicked'|samples"),
    "vocabulary": (make_plan(vocab=100_000), r"100000 rows"),
    "limit": (make_plan(max_ids=64), r"max_ids_per_partition 64"),
    "minibatching": (make_plan(minibatching=True), r"layout: minibatched \(batch\) vs plain"),
    "devices": (make_plan(devices=2), r"topology: 2 device\(s\)"),
}


def grads_for(acts: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {name: jnp.ones_like(a) for name, a in acts.items()}


@pytest.mark.parametrize("mistake", sorted(OTHER_PLANS))
def test_batch_of_another_plan_is_refused_by_every_op(mistake: str, kernels: str) -> None:
    other, names = OTHER_PLANS[mistake]
    batch = make_batch(other)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    acts = ops.lookup(PLAN, make_batch(PLAN), variables)
    for call in (lambda: ops.lookup(PLAN, batch, variables),
                 lambda: ops.lookup_grad(PLAN, batch, variables, grads_for(acts)),
                 lambda: jax.jit(lambda b, v: ops.lookup(PLAN, b, v))(batch, variables)):
        with pytest.raises(ValueError, match=r"preprocessed for another plan.*" + names):
            call()


def test_batch_missing_a_stack() -> None:
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    with pytest.raises(ValueError, match=r"holds stacks \[\] .*missing \['items'\]"):
        ops.lookup(PLAN, dataclasses.replace(batch, stacks={}), variables)


def test_variables_and_gradients_keyed_by_other_names() -> None:
    """A stack missing from the variables, a feature's gradients missing or misspelt, or
    given for a feature the plan lacks: one error listing the missing and unknown names
    (a bare KeyError from inside the ops before, and gradients of an unknown feature were
    silently left out)."""
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    grads = grads_for(ops.lookup(PLAN, batch, variables))
    with pytest.raises(ValueError, match=r"lookup: the tables are keyed by \[\], the plan's are "
                                         r"\['items'\] \(missing \['items'\], unknown \[\]\)"):
        ops.lookup(PLAN, batch, {})
    with pytest.raises(TypeError, match="lookup: the tables must map names to arrays, got list"):
        ops.lookup(PLAN, batch, [variables["items"]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"lookup_grad: the variables .*missing \['items'\], "
                                         r"unknown \['item'\]"):
        ops.lookup_grad(PLAN, batch, {"item": variables["items"]}, grads)
    for wrong, names in (({"clicked": grads["clicked"]}, r"missing \['history'\], unknown \[\]"),
                         ({**grads, "Clicked": grads["clicked"]}, r"missing \[\], unknown "
                                                                  r"\['Clicked'\]")):
        with pytest.raises(ValueError, match=f"lookup_grad: the activation gradients .*{names}"):
            ops.lookup_grad(PLAN, batch, variables, wrong)
    for clip in ({"items": 3}, {"items": (1.0,)}, {"items": (float("nan"), 1.0)},
                 {"items": (2.0, 1.0)}):
        with pytest.raises(ValueError, match=r"UpdateOptions: clip\['items'\] must be \(min, max\)"):
            ops.UpdateOptions(clip=clip)  # type: ignore[arg-type]


@pytest.mark.parametrize("mistake", ["fewer rows", "other width", "slot shape"])
def test_tables_of_another_plan(mistake: str, kernels: str) -> None:
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    acts = ops.lookup(PLAN, batch, variables)
    if mistake == "fewer rows":
        bad = ops.init_tables(make_plan(vocab=200), jax.random.key(0))
    elif mistake == "other width":
        bad = ops.init_tables(make_plan(dim=8), jax.random.key(0))
    else:
        v = variables["items"]
        bad = {"items": ops.EmbeddingVariables(v.table, (v.slots[0][:-8],))}
    match = r"Stack 'items': each device's (table|slot 0) shard is"
    if mistake != "slot shape":
        with pytest.raises(ValueError, match=match):
            ops.lookup(PLAN, batch, bad)
    with pytest.raises(ValueError, match=match):
        ops.lookup_grad(PLAN, batch, bad, grads_for(acts))


def test_gradients_of_another_shape(kernels: str) -> None:
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    acts = ops.lookup(PLAN, batch, variables, stacked=True)
    wrong = {name: jnp.ones((a.shape[0] // 2, a.shape[1])) for name, a in acts.items()}
    with pytest.raises(ValueError, match=r"Stack 'items': each device's activation gradients"):
        ops.lookup_grad(PLAN, batch, variables, wrong, stacked=True)


def test_a_feature_gradient_of_another_shape_is_named(kernels: str) -> None:
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    grads = dict(grads_for(ops.lookup(PLAN, batch, variables)))
    name = sorted(grads)[0]
    rows, width = grads[name].shape
    grads[name] = jnp.ones((rows, width + 1))
    with pytest.raises(ValueError, match=rf"Gradient of feature '{name}' has shape "
                                         rf"\({rows}, {width + 1}\); expected \({rows}, {width}\)"):
        ops.lookup_grad(PLAN, batch, variables, grads)


def test_variables_of_another_optimizer(kernels: str) -> None:
    """Slots for SGD (none) where the plan's Adagrad keeps one: refused before updating."""
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    acts = ops.lookup(PLAN, batch, variables)
    bare = {"items": ops.EmbeddingVariables(variables["items"].table, ())}
    with pytest.raises(ValueError, match=r"Stack 'items': the variables carry 0 slot\(s\) but "
                                         r"Adagrad keeps 1 \(accumulator\)"):
        ops.lookup_grad(PLAN, batch, bare, grads_for(acts))


@pytest.mark.parametrize("step", [-1, 2**31 - 1, 2**31, 1.5, np.array([1, 2])])
def test_steps_outside_the_int32_count_are_refused(step: Any) -> None:
    """A negative step made Adam's bias correction non-finite; past 2**31 it would wrap, and
    at 2**31 - 1 Adam's and LaProp's 1-based count `step + 1` wrapped (NaN rows)."""
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    acts = ops.lookup(PLAN, batch, variables)
    with pytest.raises(ValueError, match=r"step must be"):
        ops.lookup_grad(PLAN, batch, variables, grads_for(acts), step=step)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int32"])
def test_slots_of_another_dtype_are_refused(dtype: str, kernels: str) -> None:
    """A non-float32 accumulator was taken on XLA's path (its values rounded) and reached
    the CPU kernels as an FFI operand error naming neither stack nor slot."""
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    acts = ops.lookup(PLAN, batch, variables)
    table, (accumulator,) = variables["items"].table, variables["items"].slots
    wrong = {"items": ops.EmbeddingVariables(table, (accumulator.astype(dtype),))}
    with pytest.raises(ValueError, match=rf"Stack 'items': slot 0 \('accumulator'\) is {dtype} "
                                         "but optimizer slots are float32"):
        ops.lookup_grad(PLAN, batch, wrong, grads_for(acts))


def test_arrays_of_the_other_byte_order_give_the_native_results(kernels: str) -> None:
    """A big-endian numpy table or gradient, after a first call with native ones, was read
    by jit's cached dispatch as native bytes: garbage activations, a lost update."""
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    table = np.asarray(variables["items"].table)
    swapped = table.astype(table.dtype.newbyteorder(">" if table.dtype.isnative else "<"))
    native = ops.lookup(PLAN, batch, {"items": table})
    other = ops.lookup(PLAN, batch, {"items": swapped})
    for name in native:
        np.testing.assert_array_equal(np.asarray(other[name]), np.asarray(native[name]))
    grads = {name: np.asarray(g) for name, g in grads_for(native).items()}
    grads_swapped = {name: g.astype(g.dtype.newbyteorder(">" if g.dtype.isnative else "<"))
                     for name, g in grads.items()}
    want = ops.lookup_grad(PLAN, batch, variables, grads)["items"]
    got = ops.lookup_grad(PLAN, batch, variables, grads_swapped)["items"]
    np.testing.assert_array_equal(np.asarray(got.table), np.asarray(want.table))
    np.testing.assert_array_equal(np.asarray(got.slots[0]), np.asarray(want.slots[0]))


def test_hand_built_batch_is_measured_against_the_layout(kernels: str) -> None:
    """No signature (a batch built by hand): buffers of another size are still refused."""
    batch = dataclasses.replace(make_batch(make_plan(minibatching=True)), made_for=None)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    with pytest.raises(ValueError, match=r"Stack 'items': each device's buffers hold"):
        ops.lookup(PLAN, batch, variables)
    ragged = dataclasses.replace(make_batch(PLAN), made_for=None)
    buffers = ragged.stacks["items"]
    short = dataclasses.replace(buffers, gains=buffers.gains[:, :-8])
    with pytest.raises(ValueError, match=r"COO buffers differ in size"):
        ops.lookup(PLAN, dataclasses.replace(ragged, stacks={"items": short}), variables)


# --- in a subprocess: what a crash would look like ---------------------------------------------

_SUBPROCESS = textwrap.dedent("""
    import dataclasses, json, sys
    import numpy as np, jax, jax.numpy as jnp
    sys.path.insert(0, {tests!r})
    from test_hostile_ops import PLAN, make_batch, make_plan
    from tilecore import ops
    out = {{}}
    variables = ops.init_tables(PLAN, jax.random.key(0))
    for name, other in [("batch size", make_plan(batch=128, max_ids=256)),
                        ("vocabulary", make_plan(vocab=100_000, max_ids=256)),
                        ("garbage ids", None)]:
        if other is None:
            batch = make_batch(PLAN)
            b = batch.stacks["items"]
            rng = np.random.default_rng(1)
            b = dataclasses.replace(
                b, embedding_ids=rng.integers(-2**31, 2**31 - 1, b.embedding_ids.shape,
                                              dtype=np.int64).astype(np.int32),
                sample_ids=rng.integers(-2**31, 2**31 - 1, b.sample_ids.shape,
                                        dtype=np.int64).astype(np.int32),
                row_pointers=rng.integers(-2**31, 2**31 - 1, b.row_pointers.shape,
                                          dtype=np.int64).astype(np.int32))
            batch = dataclasses.replace(batch, stacks={{"items": b}})
        else:
            batch = make_batch(other)
        batch = dataclasses.replace(batch, made_for=None)
        try:
            acts = ops.lookup(PLAN, batch, variables, stacked=True)
            new = ops.lookup_grad(PLAN, batch, variables,
                                  {{k: jnp.ones_like(a) for k, a in acts.items()}}, stacked=True)
            jax.block_until_ready(new)
            out[name] = "ran"
        except ValueError as error:
            out[name] = "error: " + str(error)[:200]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("wing", ["ffi", "xla"])
def test_hand_built_batches_never_crash_the_kernels(wing: str) -> None:
    """Same sizes as the plan's layout but addressing rows and samples of another plan
    (or random): the process survives and either raises or runs (the entries outside
    the shard or sample range are skipped)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu", TILECORE_KERNELS=wing)
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _SUBPROCESS.format(tests=tests)], env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    outcomes: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(outcomes) == {"batch size", "vocabulary", "garbage ids"}, outcomes
    assert all(o == "ran" or o.startswith("error: Stack 'items'") for o in outcomes.values()), (
        outcomes)


def test_clip_bounds_a_half_table_cannot_hold_are_refused() -> None:
    """Rows clipped to 1e5 were written to a float16 table as inf; infinite bounds (no
    clipping on that side) stay allowed."""
    items = tc.TableSpec(name="items", vocab_size=64, embedding_dim=8, combiner="sum",
                         weights_dtype=jnp.float16)
    plan = tc.plan_stacking([tc.FeatureSpec(name="f", table=items, input_shape=(16, 1))],
                            tc.Topology(global_devices=1, sc_per_device=2))
    batch, _ = tc.preprocess(plan, {"f": np.arange(16).reshape(16, 1)})
    variables = ops.init_tables(plan, jax.random.key(0))
    grads = {"f": jnp.ones((16, 8))}
    with pytest.raises(ValueError, match=r"clip\['items'\] = \(100000.0, 200000.0\) reaches beyond "
                                         r"the float16 values .* \(at most 65504 in size\)"):
        ops.lookup_grad(plan, batch, variables, grads,
                        options=ops.UpdateOptions(clip={"items": (1e5, 2e5)}))
    out = ops.lookup_grad(plan, batch, variables, grads,
                          options=ops.UpdateOptions(clip={"items": (-np.inf, 1.0)}))
    assert np.isfinite(np.asarray(out["items"].table, np.float32)).all()


def test_a_minibatch_count_out_of_range_or_no_batch_is_refused() -> None:
    """0, -1 or 65 minibatches ran, reading minibatches that do not exist (or none); a
    batch that is not one was an AttributeError from inside."""
    plan = make_plan(minibatching=True)
    batch = make_batch(plan)
    variables = ops.init_tables(plan, jax.random.key(0))
    for count in (0, -1, 65, np.array([2, 0]), 1.5):
        with pytest.raises(ValueError, match=r"lookup: the batch's num_minibatches (is .*; a batch "
                                             r"of this plan has 1 to 64|must be integers)"):
            ops.lookup(plan, dataclasses.replace(batch, num_minibatches=count), variables)
    with pytest.raises(ValueError, match="num_minibatches is 2; a batch of this plan has 1 to 1"):
        ops.lookup(PLAN, dataclasses.replace(make_batch(PLAN), num_minibatches=2),
                   ops.init_tables(PLAN, jax.random.key(0)))
    with pytest.raises(TypeError, match=r"lookup: the batch must be the PreprocessedBatch that "
                                        r"tilecore.preprocess returns, got NoneType"):
        ops.lookup(plan, None, variables)  # type: ignore[arg-type]
    # Hand-made batches whose parts are not what preprocessing writes.
    junk_stacks = {name: "x" for name in batch.stacks}
    for change, message in (({"made_for": "x"}, r"made_for must be None .* got 'x'"),
                            ({"made_for": [1, 2]}, r"made_for must be None .* got \[1, 2\]"),
                            ({"stacks": ["items"]}, "stacks must map stack names to StackBuffers, "
                                                    "got list"),
                            ({"stacks": junk_stacks}, r"stacks must hold StackBuffers, got "
                                                      r"\{'items': 'str'\}")):
        with pytest.raises(TypeError, match=f"lookup: the batch's {message}"):
            ops.lookup(plan, dataclasses.replace(batch, **change), variables)


@pytest.mark.parametrize(("buffer", "dtype"), [("row_pointers", np.uint32),
                                               ("embedding_ids", np.float32),
                                               ("gains", np.float16), ("gains", np.int32)])
def test_buffers_of_another_dtype_name_the_stack_and_buffer(kernels: str, buffer: str,
                                                            dtype: Any) -> None:
    """The CPU kernels' registration refused them naming an internal FFI target; the XLA
    wing computed with int32 gains."""
    batch = make_batch(PLAN)
    with np.errstate(invalid="ignore"):  # the filler gains are NaN
        stacks = {name: dataclasses.replace(s, **{buffer: getattr(s, buffer).astype(dtype)})
                  for name, s in batch.stacks.items()}
    with pytest.raises(ValueError, match=rf"Stack 'items': the batch's buffers \{{'{buffer}': "
                                         rf"'{np.dtype(dtype).name}'\}} must be int32"):
        ops.lookup(PLAN, dataclasses.replace(batch, stacks=stacks, made_for=None),
                   ops.init_tables(PLAN, jax.random.key(0)))


def test_a_probe_of_other_features_or_shapes_is_refused() -> None:
    """A KeyError, a broadcasting error or custom_vjp's type error from inside before."""
    batch = make_batch(PLAN)
    variables = ops.init_tables(PLAN, jax.random.key(0))
    probe = ops.activation_probe(PLAN)
    with pytest.raises(ValueError, match=r"embed: the probe's arrays are keyed by \['clicked'\], "
                                         r"the plan's are \['clicked', 'history'\]"):
        ops.embed(PLAN, batch, variables, {"clicked": probe["clicked"]})
    with pytest.raises(ValueError, match=r"embed: the probe of feature 'history' has shape "
                                         r"\(128, 16\); expected \(64, 16\)"):
        ops.embed(PLAN, batch, variables, {**probe, "history": jnp.zeros((128, 16))})
    with pytest.raises(TypeError, match="embed: the probe's arrays must map names to arrays"):
        ops.embed(PLAN, batch, variables, None)  # type: ignore[arg-type]


def test_to_local_refuses_leaves_that_are_not_global_arrays() -> None:
    with pytest.raises(TypeError, match=r"to_local: expected global jax.Arrays.*ndarray"):
        distributed.to_local({"a": np.zeros(3)})
    assert np.array_equal(distributed.to_local({"a": jnp.arange(3)})["a"], np.arange(3))


def test_processes_holding_different_numbers_of_devices_are_refused() -> None:
    """(2, 1, 1) local devices failed deep inside JAX's multihost reshape."""
    from types import SimpleNamespace

    from tilecore.ops._contract import check_even_processes

    devices = np.array([SimpleNamespace(process_index=p) for p in (0, 0, 1, 2)], dtype=object)
    with pytest.raises(ValueError, match=r"init_tables: the processes hold different numbers "
                                         r"of the mesh's devices \(\{0: 2, 1: 1, 2: 1\}"):
        check_even_processes(SimpleNamespace(devices=devices), "init_tables")  # type: ignore[arg-type]
    even = np.array([SimpleNamespace(process_index=p) for p in (0, 0, 1, 1)], dtype=object)
    check_even_processes(SimpleNamespace(devices=even), "init_tables")  # type: ignore[arg-type]
