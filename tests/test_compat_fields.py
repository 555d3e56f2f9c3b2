"""Compat's spec shells hold exactly the fields of the native specs (under the reference's
spellings): a field added natively that compat does not carry fails here, not in a user's run."""

from __future__ import annotations

import dataclasses

import pytest

import tilecore as tc
from tilecore.compat import _fields
from tilecore.compat.lib.nn import embedding_spec
from tilecore.stacking import StackSpec

# Fields a compat shell has beyond its native spec: the reference's in-place stacking record.
COMPAT_ONLY = {
    embedding_spec.TableSpec: {"_initialized", "_stacked_table_spec", "_setting_in_stack"},
    embedding_spec.FeatureSpec: {"_id_transformation"},
    embedding_spec.StackedTableSpec: {"activation_mem_bytes_limit"},
    embedding_spec.QuantizationConfig: set(),
}
PAIRS = [(tc.TableSpec, embedding_spec.TableSpec), (tc.FeatureSpec, embedding_spec.FeatureSpec),
         (StackSpec, embedding_spec.StackedTableSpec),
         (tc.QuantizationConfig, embedding_spec.QuantizationConfig)]


@pytest.mark.parametrize(("native", "shell"), PAIRS, ids=lambda t: t.__name__)
def test_shell_fields_are_the_native_fields(native: type, shell: type) -> None:
    expected = {_fields.compat_name(native, f.name) for f in dataclasses.fields(native)
                if f.name not in _fields.NATIVE_ONLY[native]}
    got = {f.name for f in dataclasses.fields(shell)} - COMPAT_ONLY[shell]
    assert got == expected, (
        f"{shell.__name__} has {sorted(got - expected)} beyond and lacks {sorted(expected - got)}"
        f" of {native.__name__}'s fields: update compat/_fields.py and the shell together."
    )


def test_every_native_spec_with_a_shell_is_mapped() -> None:
    assert set(_fields.RENAMED) == set(_fields.NATIVE_ONLY) == {n for n, _ in PAIRS}


def test_conversions_round_trip_every_field() -> None:
    quant = embedding_spec.QuantizationConfig(min_value=-1.0, max_value=1.0, num_buckets=16)
    table = embedding_spec.TableSpec(
        name="t", vocabulary_size=100, embedding_dim=12, initializer=None,
        optimizer=embedding_spec.AdagradOptimizerSpec(learning_rate=0.5), combiner="mean",
        max_ids_per_partition=32, max_unique_ids_per_partition=16,
        suggested_coo_buffer_size_per_device=512, quantization_config=quant)
    from tilecore.compat._native import native_table

    native = native_table(table)
    assert _fields.compat_kwargs(tc.TableSpec, native, {
        "optimizer": lambda _: table.optimizer,
        "quantization": lambda q: embedding_spec.QuantizationConfig(
            **_fields.compat_kwargs(tc.QuantizationConfig, q)),
    }) == {f: getattr(table, f) for f in _fields.compat_kwargs(tc.TableSpec, native)}
    assert native.vocab_size == 100 and native.quantization == tc.QuantizationConfig(
        min_value=-1.0, max_value=1.0, num_buckets=16)
