"""Profiling: a trace of the whole run, and named host stages in it.

`jax.profiler.trace(dir)` records host and device activity in a form that
TensorBoard's profile plugin and Perfetto open. Host stages (preprocess,
wait_for_batch, step, eval, …) appear as `TraceAnnotation` spans; device work
appears under the `jax.named_scope`s of the step (sc_forward, tc_forward_backward,
sc_backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import jax


def annotate(name: str) -> contextlib.AbstractContextManager[object]:
    """A span named `name` on the host timeline of the trace (cheap when not tracing)."""
    return jax.profiler.TraceAnnotation(name)


@contextlib.contextmanager
def maybe_trace(directory: Path | None) -> Iterator[None]:
    """Trace everything inside into `directory` (nothing if None)."""
    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(directory)):
        yield
