"""Host preprocessing: sparse inputs → packed, partitioned COO buffers and statistics.

Imports numpy and numba only (never JAX), so it runs in data-loader workers.
"""

from ._agreement import Agreement as Agreement
from ._agreement import LocalAgreement as LocalAgreement
from ._errors import IdDroppingWarning as IdDroppingWarning
from ._errors import LimitExceededError as LimitExceededError
from ._errors import PeerPreprocessingError as PeerPreprocessingError
from ._flat import FlatFeature as FlatFeature
from ._flat import flatten as flatten
from ._limits import check_limits as check_limits
from ._limits import coo_buffer_size_per_device as coo_buffer_size_per_device
from ._limits import row_pointers_size_per_device as row_pointers_size_per_device
from ._observed import update_preprocessing_parameters as update_preprocessing_parameters
from ._preprocess import FeatureInput as FeatureInput
from ._preprocess import preprocess as preprocess
from ._signature import batch_signature as batch_signature
from ._signature import signature_differences as signature_differences
from ._threads import NUM_THREADS_ENV as NUM_THREADS_ENV
from ._threads import resolve_num_threads as resolve_num_threads
from ._types import PreprocessedBatch as PreprocessedBatch
from ._types import PreprocessStats as PreprocessStats
from ._types import Ragged as Ragged
from ._types import StackBuffers as StackBuffers

__all__ = [
    "NUM_THREADS_ENV",
    "Agreement",
    "FeatureInput",
    "FlatFeature",
    "IdDroppingWarning",
    "LimitExceededError",
    "LocalAgreement",
    "PeerPreprocessingError",
    "PreprocessStats",
    "PreprocessedBatch",
    "Ragged",
    "StackBuffers",
    "batch_signature",
    "check_limits",
    "coo_buffer_size_per_device",
    "flatten",
    "preprocess",
    "resolve_num_threads",
    "row_pointers_size_per_device",
    "signature_differences",
    "update_preprocessing_parameters",
]
