"""Hostile cases for `tilecore.layers`: a layer given variables or a mesh that do not fit
its plan says which stack or axis, and the shapes or names, before the ops fail obscurely.
"""

from __future__ import annotations

import flax.nnx as nnx
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import tilecore as tc
from tilecore import layers


def plan_of(dim: int = 8, vocab: int = 64) -> tc.StackingPlan:
    table = tc.TableSpec(name="t", vocab_size=vocab, embedding_dim=dim,
                         optimizer=tc.Adagrad(learning_rate=0.1))
    return tc.plan_stacking([tc.FeatureSpec(name="f", table=table, input_shape=(16, 1))],
                            tc.Topology(global_devices=1, sc_per_device=4))


def batch_of(plan: tc.StackingPlan) -> tc.PreprocessedBatch:
    return tc.preprocess(plan, {"f": np.arange(16).reshape(16, 1) % 64})[0]


@pytest.mark.parametrize(("dim", "vocab", "shape"), [(16, 64, r"\(64, 16\)"),
                                                      (8, 128, r"\(128, 8\)")])
def test_variables_of_another_plan_are_named_by_stack_and_shape(dim: int, vocab: int,
                                                                 shape: str) -> None:
    """They were blamed on "the probe" (the first array the ops compared) for another width."""
    plan, other = plan_of(), plan_of(dim=dim, vocab=vocab)
    variables = layers.LinenEmbed(other).init(jax.random.key(0), batch_of(other))
    with pytest.raises(ValueError, match=rf"LinenEmbed '': the table of stack 't' \(tables t\) "
                                         rf"has shape {shape}; this layer's plan makes it "
                                         r"\(64, 8\)"):
        layers.LinenEmbed(plan).apply(variables, batch_of(plan))


def test_nnx_tables_of_another_plan_are_named() -> None:
    plan = plan_of()
    model = layers.NnxEmbed(plan, rngs=nnx.Rngs(0))
    model.tables.set_value(layers.NnxEmbed(plan_of(dim=16), rngs=nnx.Rngs(0)).tables.get_value())
    with pytest.raises(ValueError, match=r"NnxEmbed: the table of stack 't' .* has shape "
                                         r"\(64, 16\); this layer's plan makes it \(64, 8\)"):
        model(batch_of(plan))


def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("sc",))


def test_linen_axis_not_in_the_mesh_is_named() -> None:
    """It was JAX's "Resource axis: nope of P('nope', None) is not found in mesh"."""
    plan = plan_of()
    with pytest.raises(ValueError, match=r"LinenEmbed '': the mesh has axes \('sc',\), not 'nope'; "
                                         r"pass axis= the mesh axis"):
        layers.LinenEmbed(plan, mesh=one_device_mesh(), axis="nope").init(
            jax.random.key(0), batch_of(plan))


def test_nnx_axis_not_in_the_mesh_is_named() -> None:
    with pytest.raises(ValueError, match=r"NnxEmbed: the mesh has axes \('sc',\), not 'nope'; "
                                         r"pass axis= the mesh axis"):
        layers.NnxEmbed(plan_of(), rngs=nnx.Rngs(0), mesh=one_device_mesh(), axis="nope")


def test_init_tables_names_an_axis_not_in_the_mesh_and_a_mesh_of_other_devices() -> None:
    """`ops.init_tables` called directly: JAX's "Resource axis ... not found in mesh" before;
    a mesh of another device count split a plan's rows the wrong number of ways."""
    plan = plan_of()
    with pytest.raises(ValueError, match=r"init_tables: the mesh has axes \('sc',\), not 'nope'"):
        tc.ops.init_tables(plan, jax.random.key(0), mesh=one_device_mesh(), axis="nope")
    two = tc.plan_stacking(list(plan.features.values()),
                           tc.Topology(global_devices=2, sc_per_device=1))
    with pytest.raises(ValueError, match=r"init_tables: the mesh splits 'sc' over 1 devices but "
                                         r"the plan was built for 2"):
        tc.ops.init_tables(two, jax.random.key(0), mesh=one_device_mesh(), axis="sc")


class _Tower(nnx.Module):
    def __init__(self, plan: tc.StackingPlan) -> None:
        self.embed = layers.NnxEmbed(plan, rngs=nnx.Rngs(0))
        self.out = nnx.Linear(8, 1, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("wrt", [layers.PARAMS_AND_PROBES, ..., layers.Tables])
def test_embed_optimizer_refuses_a_wrt_that_optimizes_the_probe_or_tables(wrt: object) -> None:
    """wrt=PARAMS_AND_PROBES was taken: optax moved the probe off zero, which shifted every
    later activation by it without an error."""
    import optax

    with pytest.raises(ValueError, match=r"EmbedOptimizer: wrt=.* selects the (Probe|Tables) "
                                         r"variable 'embed/(probe|tables)' of the NnxEmbed at "
                                         r"'embed'"):
        layers.EmbedOptimizer(_Tower(plan_of()), optax.sgd(0.1), wrt=wrt)
    layers.EmbedOptimizer(_Tower(plan_of()), optax.sgd(0.1))  # the default: params only


@pytest.mark.parametrize("plan", [None, {"f": 1}])
def test_a_layer_without_a_plan_is_named(plan: object) -> None:
    """It was AttributeError: 'NoneType' object has no attribute 'stacks' (deep in ops)."""
    with pytest.raises(TypeError, match=r"NnxEmbed: plan must be the StackingPlan"):
        layers.NnxEmbed(plan, rngs=nnx.Rngs(0))  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"LinenEmbed '': plan must be the StackingPlan"):
        layers.LinenEmbed(plan).init(jax.random.key(0), None)  # pyright: ignore[reportArgumentType]


def test_nnx_embed_without_rngs_is_named() -> None:
    """It was AttributeError: 'NoneType' object has no attribute 'params'."""
    with pytest.raises(TypeError, match=r"NnxEmbed: rngs must be an nnx.Rngs .* got NoneType"):
        layers.NnxEmbed(plan_of(), rngs=None)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_integer_activation_gradients_are_named(dtype: type) -> None:
    """They were cast and applied without a word."""
    plan = plan_of()
    model = layers.NnxEmbed(plan, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=rf"NnxEmbed: the activation gradient of feature 'f' is "
                                        rf"{np.dtype(dtype).name}; gradients are floating"):
        model.update(batch_of(plan), {"f": np.ones((16, 8), dtype)})
    model.update(batch_of(plan), {"f": np.ones((16, 8), jax.numpy.bfloat16)})
