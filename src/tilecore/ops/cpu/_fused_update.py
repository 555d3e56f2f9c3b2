"""The fused backward pass: each row's gradient summed and its optimizer step applied in one
pass over the sorted buffers, while the row (and its slots) are in cache.

One kernel module is generated per update rule: the rule's scalar source
(`_rule_source`) followed by two kernels that call it per element,
- `update_buffers`: one device's own buffers (`Wing.update_local`), partition by
  partition, rows produced by `_segments.next_row` (or, for a partition whose
  runs are not sorted, by sorting its entries);
- `update_rows`: a list of distinct rows with their summed gradients (the mesh
  path, after the entries have travelled to their owner device).
The module is written to tilecore's cache directory, so numba's on-disk cache
keeps its machine code across processes. A rule that is not elementwise has no
kernels here; the wing applies it with JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numba
import numpy as np

from ..._numba import source_stamp
from ...optimizers import update_rule
from ...specs import OptimizerSpec
from .._activations import ActivationSlice
from .._layout import StackLayout
from .._rounding import Rounding
from .._variables import EmbeddingVariables
from . import _kernels
from ._ffi import FfiKernel, _cache_dir, register_kernel, write_source
from ._rule_source import RuleSource, hyper_kind, rule_source
from ._vector import TABLE_FORMATS

_TEMPLATE = '''

_jit = njit(nogil=True, cache={cache}, error_model="numpy", boundscheck=False)
rule = numba.njit(inline="always", cache={cache}, error_model="numpy")(rule)


@_jit
def apply_row(r, acc, hf, hi, {outs}):
    """The rule on row `r` of the table and slots, `acc` its gradient; the row clipped."""
    low, high = hf[hf.shape[0] - 2], hf[hf.shape[0] - 1]
{hypers}
    for d in range(acc.shape[0]):
        new = rule({call})
        out_table[r, d] = {store}
{writes}


@_jit
def update_buffers(layout, which, row_pointers, embedding_ids, sample_ids, gains, slices, hf,
                   hi, {ins}, grads, {outs}, part, parts):
    n, rows_per_shard, samples = layout[0], layout[3], layout[4]
    first, stop = rows_per_shard * part // parts, rows_per_shard * (part + 1) // parts
    period = rows_per_shard  # part owns local rows [first, stop) of every partition
    grad_rows = _kernels.gradient_rows(layout, slices, grads, out_table.shape[1])
    if grad_rows is None:
        return 1
{copies}
    bounds = _packed.run_bounds(layout, which, row_pointers, embedding_ids.shape[0])
    acc = np.empty(out_table.shape[1], np.float32)
    for p in range(n):
        base = p * rows_per_shard
        if _segments.runs_sorted(bounds, p, embedding_ids, sample_ids, rows_per_shard, samples):
            cursors = bounds[:, p, 0].copy()
            stops = bounds[:, p, 1].copy()
            _segments.clip_runs(cursors, stops, embedding_ids, sample_ids, rows_per_shard, samples,
                                first, stop)
            while True:
                row = _segments.next_row(cursors, stops, embedding_ids, sample_ids, gains,
                                         grad_rows, rows_per_shard, samples, acc)
                if row < 0:
                    break
                upcoming = _segments.upcoming_row(cursors, stops, embedding_ids, rows_per_shard)
                if upcoming >= 0:
{prefetches}
                apply_row(base + row, acc, hf, hi, {outs})
        else:
            rows, smp, gns = _segments.partition_entries(bounds, p, embedding_ids, sample_ids,
                                                         gains, rows_per_shard, samples)
            for k in range(rows.shape[0]):  # this part's rows only
                if rows[k] < first or rows[k] >= stop:
                    rows[k] = -1
            unique = np.empty(rows.shape[0], np.int32)
            sums = np.empty((rows.shape[0], acc.shape[0]), np.float32)
            count = np.zeros(1, np.int32)
            _kernels._aggregate(rows, smp, gns, grad_rows, unique, sums, count)
            for u in range(count[0]):
                apply_row(base + unique[u], sums[u], hf, hi, {outs})
    return 0


@_jit
def update_rows(rows, sums, count, hf, hi, {ins}, {outs}, part, parts):
    num_rows = out_table.shape[0]
    first, stop = num_rows * part // parts, num_rows * (part + 1) // parts
    period = 0  # part owns rows [first, stop)
{copies}
    for i in range(min(count[0], rows.shape[0])):
        r = rows[i]
        if first <= r < stop:
            apply_row(r, sums[i], hf, hi, {outs})
    return 0
'''


_STORE = "np.minimum(np.maximum(new[0], low), high)"
_HALF_HYPERS = """
    source_format = hi[hi.shape[0] - 3]
    key, first_row = hi[hi.shape[0] - 2], hi[hi.shape[0] - 1]"""
_HALF_STORE = ("_round16.narrow(np.minimum(np.maximum(new[0], low), high), source_format, "
               "_round16.value_bits(key, first_row + r, d))")


def _module_source(rule: RuleSource, cached: bool, half: bool = False) -> str:
    """The kernels' module for `rule`; `half`: the table holds 16-bit values (uint16 bits),
    widened on read and written back with stochastic rounding (`_round16`), the format,
    rounding key and this device's first global row being `hi`'s last three entries."""
    slots = [f"slot{i}" for i in range(rule.num_slots)]
    ins = ", ".join(["table", *slots])
    outs = ", ".join(["out_table", *(f"out_{s}" for s in slots)])
    hypers = "\n".join(
        f"    hyper{k} = {'hf' if kind == 'f' else 'hi'}[{k}]"
        for k, kind in enumerate(rule.hyper_kinds)) or "    pass"
    table = "_round16.widen(out_table[r, d], source_format)" if half else "out_table[r, d]"
    hypers += _HALF_HYPERS if half else ""
    copies = "\n".join(
        f"    if {o}.ctypes.data != {i}.ctypes.data:\n"
        f"        _vector.copy_table({o}, {i}, part, parts, period)"
        for i, o in zip(ins.split(", "), outs.split(", "), strict=True))
    return (
        "import numba\nimport numpy as np\n\nfrom tilecore._numba import njit\n"
        "from tilecore.ops.cpu import _kernels, _round16, _segments, _vector\n"
        "from tilecore.preprocessing import _packed\n\n"
        + rule.source
        + _TEMPLATE.format(
            cache=cached, ins=ins, outs=outs, hypers=hypers, copies=copies,
            prefetches="\n".join(f"                    _vector.prefetch_row({o}, base + upcoming)"
                                  for o in outs.split(", ")),
            store=_HALF_STORE if half else _STORE,
            call=", ".join(["acc[d]", table, *(f"out_{s}[r, d]" for s in slots),
                            *(f"hyper{k}" for k in range(len(rule.hyper_kinds)))]),
            writes="\n".join(f"        out_{s}[r, d] = new[{i + 1}]"
                             for i, s in enumerate(slots)) or "        pass",
        )
    )


@dataclasses.dataclass(frozen=True)
class FusedKernels:
    """The two FFI kernels of one rule, and how many slots and hyperparameters it takes."""

    rule: RuleSource
    update_buffers: FfiKernel
    update_rows: FfiKernel


def _fingerprint(text: str) -> str:
    """The generated module's key: its text and every source its compiled code embeds (numba
    caches a function with the functions it calls, and watches only its own file)."""
    payload = "\0".join([text, source_stamp(), numba.__version__, jax.__version__])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _load(rule: RuleSource, half: bool) -> types.ModuleType:
    """Import the generated module of `rule` (from the cache directory when writable).

    Called under `_LOADING`: the module is in `sys.modules` while it runs (numba finds a
    cached function's module there), and a second thread must not take it half-run.
    """
    digest = _fingerprint(_module_source(rule, cached=True, half=half))
    name = f"_tilecore_fused_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    directory = _cache_dir()
    module = types.ModuleType(name)
    if directory is None:
        code = compile(_module_source(rule, cached=False, half=half), f"<{name}>", "exec")
        return _run(module, lambda: exec(code, module.__dict__))
    folder = directory / f"fused_{digest}"  # its own folder: the FFI cache key hashes siblings
    if folder.exists() and not folder.is_dir():
        folder.unlink()  # damage in tilecore's own cache: a file where its folder goes
    folder.mkdir(exist_ok=True)
    path = folder / "kernels.py"
    write_source(path, _module_source(rule, cached=True, half=half))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader
    return _run(module, lambda: loader.exec_module(module))


def _run(module: types.ModuleType, execute: Callable[[], object]) -> types.ModuleType:
    """`module` after `execute()` runs it, in `sys.modules` meanwhile; removed again if
    it raises, so that the next call starts afresh."""
    sys.modules[module.__name__] = module
    try:
        execute()
    except BaseException:
        sys.modules.pop(module.__name__, None)
        raise
    return module


_LOADING = threading.Lock()
"""Held while a rule's kernels are generated, imported and registered (`_kernels_for`)."""


def _kernels_for(rule: RuleSource, dtype: np.dtype) -> FusedKernels:
    with _LOADING:
        key = (rule, dtype)
        if key not in _KERNELS:
            _KERNELS[key] = _register(rule, dtype)
        return _KERNELS[key]


_KERNELS: dict[tuple[RuleSource, np.dtype], FusedKernels] = {}


def _register(rule: RuleSource, dtype: np.dtype) -> FusedKernels:
    module = _load(rule, half=dtype != np.float32)
    digest = module.__name__.rsplit("_", 1)[-1]
    digest += TABLE_FORMATS[dtype][0]
    f32, i32 = np.float32, np.int32
    tables = [(dtype, 2), *[(f32, 2)] * rule.num_slots]  # slots are float32
    hyper = [(f32, 1), (i32, 1)]
    buffers = register_kernel(
        f"tilecore_fused_update_buffers_{digest}", module.update_buffers,
        args=[(i32, 1), (i32, 1), (i32, 1), (i32, 1), (i32, 1), (f32, 1), (i32, 2), *hyper,
              *tables, (f32, 2)], rets=tables, split=True, variadic="operands")
    rows = register_kernel(
        f"tilecore_fused_update_rows_{digest}", module.update_rows,
        args=[(i32, 1), (f32, 2), (i32, 1), *hyper, *tables], rets=tables, split=True)
    return FusedKernels(rule, buffers, rows)


MAX_CALL_ARGUMENTS = 30
"""CPython compiles a call of more than 30 arguments into a list turned into a tuple
(`LIST_TO_TUPLE`), which numba cannot compile: a rule whose kernels' calls would pass more
(more than 8 slots, or than 28 slots and hyperparameters together) runs in JAX."""


def fused_kernels(spec: OptimizerSpec, dtype: Any, dim: int) -> FusedKernels | None:
    """The fused kernels of `spec`'s rule on a table of `dtype` (float32, bfloat16,
    float16) and rows of `dim` values, or None when the rule must run in JAX."""
    source = _rule_source_cached(update_rule(spec), type(spec), spec, dim)
    if source is None or max(14 + 2 * source.num_slots,  # update_buffers
                             2 + source.num_slots + len(source.hyper_kinds)  # rule
                             ) > MAX_CALL_ARGUMENTS:
        return None
    return _kernels_for(source, np.dtype(dtype))


def _rule_source_cached(rule: Any, kind: type, spec: OptimizerSpec, dim: int
                        ) -> RuleSource | None:
    # The source depends on each hyperparameter's kind (float or int operand), so two specs
    # of one rule whose hyperparameters differ in kind get sources of their own.
    key = (rule, kind, len(spec.slot_names), tuple(map(hyper_kind, spec.hyperparameters(0))),
           dim)
    if key not in _SOURCES:
        _SOURCES[key] = rule_source(spec, dim)
    return _SOURCES[key]


_SOURCES: dict[Any, RuleSource | None] = {}


def _hyper_operands(rule: RuleSource, spec: OptimizerSpec, step: Any,
                    clip: tuple[float, float] | None, dtype: Any = np.float32,
                    rounding: Rounding | None = None) -> tuple[jax.Array, jax.Array]:
    """The kernel's float and int operands: hyperparameters by the kind `rule` was compiled
    for, then the clip range; for a half table the ints end with its format, rounding key
    and first global row. Raises ValueError when a hyperparameter's kind at `step` is not
    the one at step 0 (the kernel would read it as the other kind)."""
    values = spec.hyperparameters(step)
    kinds = rule.hyper_kinds
    now = tuple(map(hyper_kind, values))
    if now != kinds:
        raise ValueError(
            f"{type(spec).__name__}: its hyperparameters at step {step} are of kinds {now} "
            f"(f: float, i: int or bool, None: not a scalar), at step 0 {kinds}; each must "
            "keep its kind from step to step.")
    low, high = (-np.inf, np.inf) if clip is None else clip
    floats = [jnp.asarray(v, jnp.float32) if k == "f" else jnp.float32(0)
              for v, k in zip(values, kinds, strict=True)]
    ints = [jnp.asarray(v, jnp.int32) if k == "i" else jnp.int32(0)
            for v, k in zip(values, kinds, strict=True)]
    tail = [jnp.int32(0)]
    if rounding is not None:
        source_format = TABLE_FORMATS[np.dtype(dtype)][1]
        key = jax.lax.bitcast_convert_type(jnp.asarray(rounding.key, jnp.uint32), jnp.int32)
        tail = [jnp.int32(source_format), key, jnp.asarray(rounding.row_offset, jnp.int32)]
    return (jnp.stack([*floats, jnp.float32(low), jnp.float32(high)]),
            jnp.stack([*ints, *tail]))


def _shapes(variables: EmbeddingVariables) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (variables.table, *variables.slots)]


def _aliases(first: int, variables: EmbeddingVariables) -> dict[int, int]:
    return {first + i: i for i in range(1 + len(variables.slots))}


def _variables(arrays: Any) -> EmbeddingVariables:
    return EmbeddingVariables(arrays[0], tuple(arrays[1:]))


def fused_update_buffers(kernels: FusedKernels, flat: Any, grads: Sequence[jax.Array],
                         slices: Sequence[ActivationSlice], variables: EmbeddingVariables,
                         layout: StackLayout, spec: OptimizerSpec, step: Any,
                         clip: tuple[float, float] | None, which: jax.Array,
                         rounding: Rounding | None = None) -> EmbeddingVariables:
    """One device's variables after the fused update from its own buffers (`which` =
    [minibatch, minibatches]), each slice's gradients read where they lie (no block of
    them is built); `rounding` for a half-precision table."""
    hf, hi = _hyper_operands(kernels.rule, spec, step, clip, variables.table.dtype, rounding)
    arrays = (variables.table, *variables.slots)
    out = kernels.update_buffers(_kernels.layout_array(layout), which, *flat,
                                 _kernels.slice_operand(slices), hf, hi, *arrays, *grads,
                                 results=_shapes(variables),
                                 input_output_aliases=_aliases(9, variables))
    return _variables(out)


def fused_update_rows(kernels: FusedKernels, variables: EmbeddingVariables, rows: jax.Array,
                      sums: jax.Array, spec: OptimizerSpec, step: Any,
                      clip: tuple[float, float] | None, count: jax.Array | None,
                      rounding: Rounding | None = None) -> EmbeddingVariables:
    """The variables after the rule on the `count` leading (distinct) rows, in one pass
    (`rounding` for a half-precision table)."""
    hf, hi = _hyper_operands(kernels.rule, spec, step, clip, variables.table.dtype, rounding)
    real = jnp.int32(rows.shape[0]) if count is None else jnp.asarray(count, jnp.int32)
    arrays = (variables.table, *variables.slots)
    out = kernels.update_rows(rows, sums, real.reshape(1), hf, hi, *arrays,
                              results=_shapes(variables),
                              input_output_aliases=_aliases(5, variables))
    return _variables(out)
