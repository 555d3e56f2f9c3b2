"""Eager calls of the public ops run as one compiled program.

Called outside `jit`, a JAX function runs op by op: every primitive is compiled and
dispatched on its own. For `lookup` and `lookup_grad` on a mesh that is a few hundred
small XLA programs (about 10 s before the first result on a 2-CPU host) and a slow
dispatch ever after. An eager call therefore goes through `jit` with everything that
shapes the program static: the plan (by identity: it holds dicts, so has no value hash),
the mesh, the axis and the options. A second call with the same plan runs the cached
program; results are those of the same call under the user's own `jit`.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import jax
import numpy as np
from jax.core import Tracer

from ..preprocessing._inputs import native_order

T = TypeVar("T")
TreeT = TypeVar("TreeT")


def device_arrays(tree: TreeT) -> TreeT:
    """`tree` with every numpy leaf made a JAX array, in the host's byte order.

    The ops' entry points call this before anything else sees their arrays. jax's cached
    `jit` dispatch takes a numpy array of the other byte order (`'>f4'` here) as its
    bytes lie (a `'>f4'` table was read as garbage float32 after a first call with a
    native one, and the first call raised JAX's "Error interpreting argument"); and
    under `jax.disable_jit()` XLA's kernels update a table with `.at[]`, which a numpy
    table lacks (the CPU kernels took it)."""
    def on_device(leaf: Any) -> Any:
        return jax.numpy.asarray(native_order(leaf)) if isinstance(leaf, np.ndarray) else leaf

    return jax.tree.map(on_device, tree)


def should_jit(*trees: object) -> bool:
    """Whether an op called with `trees` runs through `jit`: called eagerly (no leaf is
    traced: outside jit, grad or vmap) with jit enabled (under `jax.disable_jit()` the
    user asked for op-by-op execution, and the jitted call would only call the op again)."""
    if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue] (a dynamic flag)
        return False
    return not any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(trees))


class ByIdentity(Generic[T]):
    """A static `jit` argument equal only to a holder of the same object.

    The jit cache keeps the holder, so the object stays alive while its program is
    cached and its `id` cannot be reused by another.
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ByIdentity) and other.value is self.value
