"""Test helpers: plain numpy oracles of host preprocessing, the device ops and the
optimizers, buffer unpacking, and hypothesis strategies.

`preprocess_reference(plan, inputs, weights)` computes, one ID at a time, what
`tilecore.preprocess` must produce; `unpack(batch, plan)` reads tilecore's packed
buffers back into the same per-(device, SparseCore) `Entries`.
`reference_lookup`, `reference_row_gradients` and `reference_lookup_grad` compute
what the device ops must return straight from the raw inputs and per-table arrays;
`reference_update` is every optimizer's formula; `reference_stochastic_round` and
`reference_rounding_bits` predict a half-precision table's writes bit for bit
(`half_ulp_gap`: the gap between a value's two half-precision neighbours, the
bound on one stochastic rounding's error). `unpack_minibatches` reads the
minibatching layout back per (device, SparseCore, minibatch);
`reference_split` and `split_into_minibatches` predict it from single-pass
entries. `repack_minibatched` turns a single-pass batch into minibatched buffers
for testing the device loop. The strategies
(`topologies`, `table_specs`, `preprocess_cases`, `PreprocessCase`) need
`hypothesis` and are imported on first use, so this package works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._device_reference import reference_lookup as reference_lookup
from ._device_reference import reference_lookup_grad as reference_lookup_grad
from ._device_reference import reference_row_gradients as reference_row_gradients
from ._entries import DeviceSc as DeviceSc
from ._entries import Entries as Entries
from ._minibatches import DeviceScMinibatch as DeviceScMinibatch
from ._minibatches import bucket_maxima as bucket_maxima
from ._minibatches import minibatch_of_buckets as minibatch_of_buckets
from ._minibatches import reference_split as reference_split
from ._minibatches import row_bucket as row_bucket
from ._minibatches import split_into_minibatches as split_into_minibatches
from ._minibatches import unpack_minibatched_stack as unpack_minibatched_stack
from ._minibatches import unpack_minibatches as unpack_minibatches
from ._optimizers import reference_update as reference_update
from ._reference import FILLER as FILLER
from ._reference import ReferenceResult as ReferenceResult
from ._reference import ReferenceStack as ReferenceStack
from ._reference import preprocess_reference as preprocess_reference
from ._reference import row_gains as row_gains
from ._repack import MinibatchOf as MinibatchOf
from ._repack import repack_minibatched as repack_minibatched
from ._rounding import half_ulp_gap as half_ulp_gap
from ._rounding import reference_rounding_bits as reference_rounding_bits
from ._rounding import reference_stochastic_round as reference_stochastic_round
from ._unpack import covered_mask as covered_mask
from ._unpack import unpack as unpack
from ._unpack import unpack_stack as unpack_stack

if TYPE_CHECKING:
    from ._strategies import PreprocessCase as PreprocessCase
    from ._strategies import Stacking as Stacking
    from ._strategies import preprocess_cases as preprocess_cases
    from ._strategies import table_specs as table_specs
    from ._strategies import topologies as topologies

_HYPOTHESIS_NAMES = frozenset(
    {"PreprocessCase", "Stacking", "preprocess_cases", "table_specs", "topologies"}
)


def __getattr__(name: str) -> Any:
    if name in _HYPOTHESIS_NAMES:
        try:
            module = importlib.import_module(f"{__name__}._strategies")
        except ModuleNotFoundError as error:
            if error.name != "hypothesis":
                raise
            raise ImportError(
                f"tilecore.testing.{name} needs hypothesis; install it with "
                "`pip install hypothesis` (or tilecore[dev])."
            ) from error
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FILLER",
    "DeviceSc",
    "DeviceScMinibatch",
    "Entries",
    "MinibatchOf",
    "PreprocessCase",
    "ReferenceResult",
    "ReferenceStack",
    "Stacking",
    "bucket_maxima",
    "covered_mask",
    "half_ulp_gap",
    "minibatch_of_buckets",
    "preprocess_cases",
    "preprocess_reference",
    "reference_lookup",
    "reference_lookup_grad",
    "reference_rounding_bits",
    "reference_row_gradients",
    "reference_split",
    "reference_stochastic_round",
    "reference_update",
    "repack_minibatched",
    "row_bucket",
    "row_gains",
    "split_into_minibatches",
    "table_specs",
    "topologies",
    "unpack",
    "unpack_minibatched_stack",
    "unpack_minibatches",
    "unpack_stack",
]
