"""`jax_tpu_embedding.sparsecore.lib.fdo` on tilecore: clients that record limit statistics."""

from typing import TYPE_CHECKING

from ..._aliases import submodule_getattr

__all__ = ["csv_file_fdo_client", "fdo_client", "file_fdo_client"]
if TYPE_CHECKING:  # the submodules load lazily; type checkers see them here
    from . import csv_file_fdo_client, fdo_client, file_fdo_client

__getattr__ = submodule_getattr(__name__, __all__)
