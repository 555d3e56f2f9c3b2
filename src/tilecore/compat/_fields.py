"""Which field of a compat spec holds which field of its native spec: the one table.

The reference spells some fields differently from tilecore (`vocabulary_size`
for `vocab_size`, `table_spec` for `table`, `stack_name` for `name`, …). Every
conversion between compat shells and native specs goes through `native_kwargs`
and `compat_kwargs`, which walk the *native* dataclass's fields: a field added to
a native spec must be named here (or in `NATIVE_ONLY`) or every conversion fails
at once, and `tests/test_compat_fields.py` checks that the shells have exactly
the fields this table promises. Compat cannot drift from native silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .. import specs as native
from ..stacking import StackSpec

RENAMED: Mapping[type, Mapping[str, str]] = {
    native.TableSpec: {"vocab_size": "vocabulary_size", "quantization": "quantization_config"},
    native.FeatureSpec: {"table": "table_spec"},
    StackSpec: {"name": "stack_name", "vocab_size": "stack_vocab_size",
                "embedding_dim": "stack_embedding_dim", "quantization": "quantization_config"},
    native.QuantizationConfig: {},
}
"""Native spec → {native field: compat field} where the names differ."""

NATIVE_ONLY: Mapping[type, frozenset[str]] = {
    # Half-precision storage has no equivalent in the reference: compat tables are
    # float32 (the native default).
    native.TableSpec: frozenset({"weights_dtype"}),
    native.FeatureSpec: frozenset(),
    # Which tables and features a stack holds: compat records it on each member spec.
    StackSpec: frozenset({"table_names", "feature_names", "weights_dtype"}),
    native.QuantizationConfig: frozenset(),
}
"""Native fields that compat shells do not hold (derived from other specs instead)."""


def compat_name(native_type: type, field: str) -> str:
    """The compat spelling of `native_type.field`."""
    return RENAMED[native_type].get(field, field)


def _native_fields(native_type: type) -> list[str]:
    return [f.name for f in dataclasses.fields(native_type)
            if f.name not in NATIVE_ONLY[native_type]]


def native_kwargs(native_type: type, shell: Any,
                  convert: Mapping[str, Callable[[Any], Any]] | None = None) -> dict[str, Any]:
    """Keyword arguments of `native_type` read from the compat `shell`.

    `convert` maps a native field to a function applied to the compat value
    (e.g. compat optimizer → native optimizer).
    """
    convert = convert or {}
    out = {}
    for field in _native_fields(native_type):
        value = getattr(shell, compat_name(native_type, field))
        out[field] = convert[field](value) if field in convert else value
    return out


def compat_kwargs(native_type: type, value: Any,
                  convert: Mapping[str, Callable[[Any], Any]] | None = None) -> dict[str, Any]:
    """Keyword arguments of a compat shell read from the native `value`."""
    convert = convert or {}
    out = {}
    for field in _native_fields(native_type):
        item = getattr(value, field)
        out[compat_name(native_type, field)] = convert[field](item) if field in convert else item
    return out
