"""Rebuilding a jaxpr with new inputs or outputs, for auto-pipelining's jaxpr surgery."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend as jex


def with_io(jaxpr: jex.core.Jaxpr, *, invars: Sequence[Any] | None = None,
            outvars: Sequence[Any] | None = None, **changes: Any) -> jex.core.Jaxpr:
    """`jaxpr` with other inputs/outputs (and any other `replace` changes), its debug
    info renamed to match (JAX wants one name per input and output)."""
    invars = list(jaxpr.invars if invars is None else invars)
    outvars = list(jaxpr.outvars if outvars is None else outvars)
    info = jex.core.DebugInfo("auto_pipelining", "auto_pipelining part",
                              tuple(f"input[{i}]" for i in range(len(invars))),
                              tuple(f"output[{i}]" for i in range(len(outvars))))
    return jaxpr.replace(invars=invars, outvars=outvars, debug_info=info, **changes)
