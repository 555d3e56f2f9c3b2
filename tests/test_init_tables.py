"""`ops.init_tables`: one compiled program per layout, values as per-shard initializer calls."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tilecore as tc
from tilecore import ops


def _plan(initializers: dict[str, Any], sc_per_device: int = 4) -> tc.StackingPlan:
    sizes = {"a": (37, 5), "b": (19, 7), "c": (50, 3), "d": (11, 8)}
    features = []
    for name, (vocab, dim) in sizes.items():
        optimizer = tc.FTRL() if name == "c" else tc.Adagrad()  # c in a stack of its own
        spec = tc.TableSpec(name=name, vocab_size=vocab, embedding_dim=dim, optimizer=optimizer,
                            initializer=initializers.get(name))
        features.append(tc.FeatureSpec(name=f"f{name}", input_shape=(8, 1), table=spec))
    return tc.plan_stacking(features, tc.Topology(global_devices=1, sc_per_device=sc_per_device))


def _counting(calls: list[tuple[int, ...]], low: float):
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        calls.append(tuple(shape))  # once per trace
        return jax.random.uniform(key, shape, dtype, minval=low, maxval=low + 1.0)
    return init


def _expected(plan: tc.StackingPlan, key: jax.Array) -> dict[str, np.ndarray]:
    """The reference layout in numpy: the key split per stack, then per partition shard;
    each table's initializer called eagerly per shard key, its block at the table's rows."""
    n = plan.num_partitions
    out = {}
    for stack_key, (name, stack) in zip(jax.random.split(key, len(plan.stacks)),
                                        plan.stacks.items(), strict=True):
        shard_keys = jax.random.split(stack_key, n)
        table = np.zeros((n, stack.vocab_size // n, stack.embedding_dim), np.float32)
        for table_name in stack.table_names:
            setting, spec = plan.table_settings[table_name], plan.tables[table_name]
            init = spec.initializer or jax.nn.initializers.truncated_normal(
                stddev=1.0 / np.sqrt(spec.embedding_dim))
            rows = setting.padded_vocab_size // n
            for p in range(n):
                table[p, setting.row_offset_in_shard:setting.row_offset_in_shard + rows] = (
                    np.asarray(init(shard_keys[p], (rows, stack.embedding_dim), jnp.float32)))
        out[name] = table.reshape(stack.vocab_size, stack.embedding_dim)
    return out


def test_values_are_the_per_shard_initializer_calls(fully_optimised: None) -> None:
    calls: list[tuple[int, ...]] = []
    plan = _plan({"a": _counting(calls, 1.0), "c": _counting(calls, -3.0)})
    assert len(plan.stacks) == 2
    for seed in (0, 7):
        key = jax.random.key(seed)
        got = ops.init_tables(plan, key)
        want = _expected(plan, key)
        assert got.keys() == want.keys()
        for name, variables in got.items():
            np.testing.assert_array_equal(np.asarray(variables.table), want[name])


def test_a_second_call_with_the_same_layout_does_not_trace_again() -> None:
    calls: list[tuple[int, ...]] = []
    init = _counting(calls, 0.0)
    plan = _plan({"a": init, "b": init, "d": init})
    first = ops.init_tables(plan, jax.random.key(1))
    traced = len(calls)
    assert traced == 3  # one trace per (table, shard shape), all in one program
    second = ops.init_tables(plan, jax.random.key(2))
    again = ops.init_tables(_plan({"a": init, "b": init, "d": init}), jax.random.key(1))
    assert len(calls) == traced  # other keys, an equal plan: the cached program runs
    for name in plan.stacks:
        np.testing.assert_array_equal(np.asarray(first[name].table), np.asarray(again[name].table))
        assert not np.array_equal(np.asarray(first[name].table), np.asarray(second[name].table))
    ops.init_tables(_plan({"a": init, "b": init, "d": init}, sc_per_device=2), jax.random.key(1))
    assert len(calls) > traced  # another shard shape is another program


def test_the_program_holds_one_block_of_temporaries_not_a_second_table(
        fully_optimised: None) -> None:
    """Each (table, shard) block is written into the stack in place, so XLA's buffer plan
    for the initializer needs scratch for one block's values, not for a whole table: here
    under half of the big table, which spans 16 shards. Building each table whole and
    concatenating needed the table and more (measured: 1.4 of it; now 0.4)."""
    vocab = {"big": 160_000, "small_a": 3_000, "small_b": 5_000}
    features = [
        tc.FeatureSpec(name=f"f_{name}", input_shape=(8, 1), table=tc.TableSpec(
            name=name, vocab_size=rows, embedding_dim=16, optimizer=tc.SGD(),
            initializer=jax.nn.initializers.uniform(0.1)))
        for name, rows in vocab.items()
    ]
    plan = tc.plan_stacking(features, tc.Topology(global_devices=1, sc_per_device=16))
    assert len(plan.stacks) == 1 and plan.num_partitions == 16
    big_bytes = vocab["big"] * 16 * 4
    compiled = jax.jit(lambda key: ops.init_tables(plan, key)).lower(jax.random.key(0)).compile()
    memory = compiled.memory_analysis()
    assert memory is not None
    assert memory.output_size_in_bytes > big_bytes
    assert memory.temp_size_in_bytes < big_bytes / 2, (memory.temp_size_in_bytes, big_bytes)


def test_tables_move_onto_huge_pages_with_their_values() -> None:
    """`use_huge_pages` moves the whole 2 MiB pages inside each CPU buffer (the kernel copies
    them) and changes no value; small buffers and non-arrays are passed over."""
    import platform

    from tilecore.ops.cpu._huge_pages import _huge_page_bytes

    table = jnp.arange(6 << 20, dtype=jnp.float32).reshape(-1, 32) * 0.5  # 24 MiB, a new buffer
    expected = np.asarray(table).copy()
    moved = ops.use_huge_pages({"table": table, "small": jnp.zeros(4)}, "not an array", None)
    np.testing.assert_array_equal(np.asarray(table), expected)
    page = _huge_page_bytes()
    release = tuple(int(p) for p in platform.release().split(".")[:2] if p.isdigit())
    if page == 0 or release < (6, 1):  # nowhere to move to: nothing moved, nothing broken
        assert moved == 0
        return
    assert moved % page == 0
    assert table.nbytes - 2 * page <= moved <= table.nbytes


def test_variables_that_cannot_fit_are_refused_before_any_allocation() -> None:
    """A 2**31-row table of dim 256 with Adagrad's slot (4 TiB): a MemoryError naming the
    size, the limit and the largest stacks, raised before anything is drawn (numpy raised
    a bare MemoryError, XLA a RESOURCE_EXHAUSTED naming no table, and a lazily committed
    allocation could fill the machine until the OOM killer ended the process)."""
    import pytest

    from tilecore import host_memory_bytes
    from tilecore.ops._memory import variables_bytes
    from tilecore_apps.dlrm._tables import init_variables

    huge = tc.TableSpec(name="huge", vocab_size=2**31 - 1024, embedding_dim=256,
                        optimizer=tc.Adagrad())
    small = tc.TableSpec(name="small", vocab_size=100, embedding_dim=8)
    plan = tc.plan_stacking(
        [tc.FeatureSpec(name="f", table=huge, input_shape=(8, 1)),
         tc.FeatureSpec(name="g", table=small, input_shape=(8, 1))],
        tc.Topology(global_devices=1, sc_per_device=4),
        tc.SparseCoreConfig(disable_table_stacking=True))
    sizes = variables_bytes(plan)
    assert sizes == {"huge": plan.stacks["huge"].vocab_size * 256 * 8, "small": 128 * 8 * 4}
    limit = host_memory_bytes()
    assert limit is not None and 0 < limit < sizes["huge"]  # a machine of under 4 TiB
    need = f"{sum(sizes.values()) / 2**30:,.1f}"
    message = (rf"need {need} GiB here, more than this host's memory and swap \(.* GiB\); the "
               rf"largest stacks: 'huge' {sizes['huge'] / 2**30:,.1f} GiB, 'small' 0\.0 GiB")
    for make in (lambda: ops.init_tables(plan, jax.random.key(0)),
                 lambda: init_variables(plan, 0)):
        with pytest.raises(MemoryError, match=message):
            make()
    ops.check_memory(tc.plan_stacking([tc.FeatureSpec(name="g", table=small, input_shape=(8, 1))],
                                      plan.topology))  # what fits passes
