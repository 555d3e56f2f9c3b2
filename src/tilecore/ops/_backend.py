"""The backend wings of the device ops, and the one place that picks between them.

What a lookup and an update *are* (routing entries to their owner device over a
mesh, one minibatch at a time, the optimizer applied per touched row) is shared
code in `tilecore.ops`. A wing supplies the few kernels that code runs per
device, as a `Wing`:

- `xla`: plain XLA ops, on every backend (`tilecore.ops.xla`);
- `cpu`: numba kernels behind XLA's typed FFI, at memory speed on CPUs
  (`tilecore.ops.cpu`);
- `pallas`: the XLA wing with the lookup's gather and combine as a Pallas kernel for
  GPUs (Triton), or in Pallas's interpreter anywhere (`tilecore.ops.pallas`).

`wing()` decides once per process ($TILECORE_KERNELS: auto, ffi, xla, pallas or
pallas-interpret; auto takes the CPU wing on the CPU backend when its FFI probe
passes, else XLA's with a warning saying why, and never the Pallas wing, whose
training step measured 6x slower than XLA's on an NVIDIA H200 at batch 4096, 23x at
65536). Public functions take no
backend flags. The numpy oracle in `tilecore.testing` is the contract every wing meets;
the tests run every wing against it (the Pallas kernels interpreted, on CPU).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from functools import cache
from typing import Any

import jax

from ._layout import StackLayout

KERNELS_ENV = "TILECORE_KERNELS"

FlatBuffers = tuple[jax.Array, jax.Array, jax.Array, jax.Array]
"""One device's `(row_pointers, embedding_ids, sample_ids, gains)`, each 1-D."""

RowGradients = tuple[jax.Array, jax.Array, jax.Array | None]
"""`(rows, sums, count)`: distinct rows (padding: a sentinel outside the shard), the
summed gradient of each, and how many leading rows are real (None: unknown)."""


@dataclasses.dataclass(frozen=True)
class Wing:
    """The kernels one backend supplies to the shared device ops.

    Attributes:
      name: "xla", "cpu" or "pallas".
      pool: `(table, rows, segments, gains, num_segments, quantization) ->
        [num_segments, dim]`, `Σ gain · table[row]` per segment; entries whose segment
        is out of range contribute nothing (quantization is None in the CPU wing).
      row_gradients: `(rows, valid, samples, gains, grads, sentinel) -> RowGradients`,
        `Σ gain · grads[sample]` per distinct row of the valid entries.
      apply_update: `(variables, rows, sums, spec, step, clip, count, rounding) ->
        variables`, the optimizer on the listed rows (see `_sparse_update`; `rounding`
        is None but for half-precision tables).
      lookup_local: `(flat, table, layout, num_minibatches, slices) -> [[S·samples,
        width], ...]`, one device's activations straight from its own buffers (no mesh),
        of each `ActivationSlice` of its `[S·samples, dim]` block.
      update_local: `(flat, grads, slices, variables, layout, spec, step, clip,
        num_minibatches, rounding) -> variables`, one device's update from its own
        buffers, `grads` one array per `ActivationSlice` of its block.
    """

    name: str
    pool: Callable[..., jax.Array]
    row_gradients: Callable[..., RowGradients]
    apply_update: Callable[..., Any]
    lookup_local: Callable[..., list[jax.Array]]
    update_local: Callable[..., Any]


@cache
def wing() -> Wing:
    """The wing the device ops run in this process (decided on first use).

    In a multi-process run every process must decide the same (checked against
    the peers that decided before, see `_check_same_choice_as_peers`).
    """
    choice = os.environ.get(KERNELS_ENV, "auto").lower()
    if choice not in ("auto", "ffi", "xla", "pallas", "pallas-interpret"):
        raise ValueError(f"${KERNELS_ENV} must be auto, ffi, xla, pallas or pallas-interpret; "
                         f"got {choice!r}.")
    if choice in ("pallas", "pallas-interpret"):
        return _pallas(choice)
    if choice == "xla" or (choice == "auto" and jax.default_backend() != "cpu"):
        reason: str | None = f"${KERNELS_ENV}={choice}, backend {jax.default_backend()}"
    elif jax.default_backend() != "cpu":  # choice == "ffi"
        raise RuntimeError(
            f"${KERNELS_ENV}=ffi asks for the numba CPU kernels, but JAX's default backend is "
            f"{jax.default_backend()!r}: its arrays are not on the CPU. Unset ${KERNELS_ENV} "
            "(auto) or set it to xla.")
    else:
        from .cpu import unavailable_reason

        reason = unavailable_reason()
        if reason is not None and choice == "ffi":
            raise RuntimeError(
                f"${KERNELS_ENV}=ffi but the CPU kernels are unavailable: {reason}")
        if reason is not None:  # said, not silent: XLA's kernels are several times slower
            warnings.warn(f"tilecore: the CPU kernels are unavailable ({reason}); the device "
                          f"ops use XLA's. Set ${KERNELS_ENV}=xla to choose them and silence "
                          "this.", RuntimeWarning, stacklevel=2)
    _check_same_choice_as_peers("ffi" if reason is None else f"xla ({reason})")
    if reason is None:
        from .cpu import WING as CPU

        return CPU
    from .xla import WING as XLA

    return XLA


def _pallas(choice: str) -> Wing:
    """The Pallas wing, compiled (`pallas`, GPUs only) or interpreted (`pallas-interpret`)."""
    backend = jax.default_backend()
    if choice == "pallas" and backend != "gpu":
        raise RuntimeError(
            f"${KERNELS_ENV}=pallas asks for the Pallas kernels compiled by Triton, which run "
            f"on GPUs, but JAX's default backend is {backend!r}. Set ${KERNELS_ENV} to "
            "pallas-interpret to run them in Pallas's interpreter (slow: for tests), or unset "
            "it (auto).")
    _check_same_choice_as_peers(choice)
    from .pallas import pallas_wing

    return pallas_wing(interpret=choice == "pallas-interpret")


def lookup_wing(layout: StackLayout) -> Wing:
    """The wing a stack's lookup runs in: quantized tables always take XLA's (the CPU and
    Pallas kernels pool full-precision rows)."""
    if layout.quantization is not None:
        from .xla import WING as XLA

        return XLA
    return wing()


_CHOICE_KEY = "tilecore/cpu_kernels/"


def _check_same_choice_as_peers(mine: str) -> None:
    """Publish this process's wing (its first word: ffi, xla, pallas or pallas-interpret,
    then why, if anything); raise if a peer already chose differently.

    Two wings compile to different programs whose collectives XLA schedules in
    a different order; in a multi-process run gloo then pairs one process's
    all-to-all with another's of a different operand (wrong activations, NaN).
    Never blocks (the first process to decide cannot see the others, a later one
    can): every process must make the same choice, and this catches most that don't.
    """
    from ..distributed._exchange import jax_store

    store = jax_store()
    if store is None or jax.process_count() == 1:
        return
    me = jax.process_index()
    store.key_value_set(f"{_CHOICE_KEY}{me}", mine, allow_overwrite=True)
    for key, theirs in store.key_value_dir_get(_CHOICE_KEY):
        if theirs.split(" ")[0] != mine.split(" ")[0]:
            raise RuntimeError(
                f"Process {me} runs the ops with {mine} but process "
                f"{key.rsplit('/', 1)[-1]} with {theirs}: every process must run the same "
                f"kernels (their collectives must match). Set ${KERNELS_ENV} to the same "
                "value on every process.")
