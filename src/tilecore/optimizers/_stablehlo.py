"""Calling a StableHLO module from JAX: a primitive whose lowering merges the module in.

An update rule may arrive as StableHLO text (the reference system's
`CustomOptimizerSpec(stablehlo=...)`) rather than as a Python function. The
primitive `call_stablehlo` parses the module into the MLIR context of the program
being lowered, merges its functions in (renamed so they cannot clash, made
private) and emits a `func.call` to its `main`. XLA inlines the call, so the rule
compiles on every backend (CPU, GPU) like any other op.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.core
import jax.extend as jex
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func as func_dialect
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir, xla

_BYTECODE_MAGIC = b"ML\xefR"

call_stablehlo_p = jex.core.Primitive("tilecore_call_stablehlo")
call_stablehlo_p.multiple_results = True


@dataclasses.dataclass(frozen=True)
class Signature:
    """Argument and result shapes of a module's `main` (all float32), and whether its
    results come packed in one tuple."""

    args: tuple[tuple[int, ...], ...]
    results: tuple[tuple[int, ...], ...]
    tuple_result: bool


def module_text(module: Any, owner: str) -> str:
    """`module` (text, UTF-8 text bytes, MLIR bytecode or an `ir.Module`) as text."""
    if isinstance(module, str):
        return module
    if isinstance(module, bytes) and not module.startswith(_BYTECODE_MAGIC):
        try:
            return module.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{owner}: the StableHLO bytes are neither UTF-8 text nor MLIR bytecode "
                f"({err}). Pass the module text, e.g. `jax.jit(f).lower(...).as_text()`."
            ) from err
    if isinstance(module, bytes | ir.Module):
        with mlir.make_ir_context():
            parsed = ir.Module.parse(module) if isinstance(module, bytes) else module
            return str(parsed)
    raise TypeError(
        f"{owner}: stablehlo must be a str, bytes or jax.extend.mlir.ir.Module; got "
        f"{type(module).__name__} {module!r:.80}."
    )


def _shape(kind: str, index: int, type_: ir.Type, owner: str) -> tuple[int, ...]:
    if not isinstance(type_, ir.RankedTensorType) or not isinstance(type_.element_type,
                                                                     ir.F32Type):
        raise ValueError(
            f"{owner}: every {kind} of the StableHLO rule must be a float32 tensor; {kind} "
            f"{index} is {type_}. Lower the rule with float32 inputs (lower_to_stablehlo)."
        )
    return tuple(type_.shape)


@functools.lru_cache(maxsize=64)
def signature(text: str, owner: str) -> Signature:
    """Parse `text` and read its `main` function's argument and result shapes (cached:
    specs convert to their native form, and so re-parse, on every call)."""
    with mlir.make_ir_context():
        try:
            module = ir.Module.parse(text)
        except ir.MLIRError as err:
            raise ValueError(f"{owner}: the StableHLO module does not parse: {err}") from err
        names = []
        for op in module.body.operations:
            if op.operation.name != "func.func":
                continue
            name = ir.StringAttr(op.attributes["sym_name"]).value
            names.append(name)
            if name == "main":
                fn_type = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                break
        else:
            raise ValueError(
                f"{owner}: the StableHLO module has no function named main (it has "
                f"{names}); the rule must be the module's `main`, as jax.jit(...).lower() "
                "writes it."
            )
        results = list(fn_type.results)
        tuple_result = len(results) == 1 and isinstance(results[0], ir.TupleType)
        if tuple_result:
            packed = ir.TupleType(results[0])
            results = [packed.get_type(i) for i in range(packed.num_types)]
        return Signature(
            args=tuple(_shape("argument", i, t, owner) for i, t in enumerate(fn_type.inputs)),
            results=tuple(_shape("result", i, t, owner) for i, t in enumerate(results)),
            tuple_result=tuple_result,
        )


def call_stablehlo(text: str, sig: Signature, *args: jax.Array) -> tuple[jax.Array, ...]:
    """Call the module's `main` on `args` (already shaped as `sig.args`, float32)."""
    out_avals = tuple(jax.core.ShapedArray(shape, jnp.float32) for shape in sig.results)
    return tuple(call_stablehlo_p.bind(*args, module=text, out_avals=out_avals,
                                       tuple_result=sig.tuple_result))


def _abstract_eval(*args: Any, module: str, out_avals: tuple[Any, ...],
                   tuple_result: bool) -> tuple[Any, ...]:
    del args, module, tuple_result
    return out_avals


def _lowering(ctx: Any, *args: Any, module: str, out_avals: tuple[Any, ...],
              tuple_result: bool) -> list[Any]:
    context = ctx.module_context
    submodule = ir.Module.parse(module, context=context.context)
    callee = mlir.merge_mlir_modules(context.module, "tilecore_stablehlo_rule", submodule,
                                     dst_symtab=context.symbol_table)
    types = [mlir.aval_to_ir_type(context, aval) for aval in out_avals]
    if not tuple_result:
        call = func_dialect.CallOp(types, ir.FlatSymbolRefAttr.get(callee), list(args))
        return list(call.results)
    call = func_dialect.CallOp([ir.TupleType.get_tuple(types)],
                               ir.FlatSymbolRefAttr.get(callee), list(args))
    return [hlo.get_tuple_element(call.result, i) for i in range(len(types))]


call_stablehlo_p.def_abstract_eval(_abstract_eval)
call_stablehlo_p.def_impl(functools.partial(xla.apply_primitive, call_stablehlo_p))
mlir.register_lowering(call_stablehlo_p, _lowering)
