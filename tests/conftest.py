"""Shared test set-up: a deterministic hypothesis profile and the kernel-path fixture."""

from __future__ import annotations

import os
from collections.abc import Iterator

import jax
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "tilecore",
    derandomize=True,
    max_examples=60,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("tilecore"), max_examples=1000)
settings.load_profile(os.environ.get("TILECORE_HYPOTHESIS_PROFILE", "tilecore"))


@pytest.fixture(params=["ffi", "xla"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`$TILECORE_KERNELS`: numba CPU kernels (ffi) or plain XLA ops.

    The choice is cached per process, so the cache is cleared before and after: each
    test runs the path it names, whichever ran before it. The CPU kernels need JAX's
    CPU backend; on an accelerator only the XLA path runs.
    """
    from tilecore.ops._backend import wing

    if request.param == "ffi" and jax.default_backend() != "cpu":
        pytest.skip(f"the CPU kernels do not run on the {jax.default_backend()} backend")
    monkeypatch.setenv("TILECORE_KERNELS", request.param)
    wing.cache_clear()
    yield request.param
    monkeypatch.undo()
    wing.cache_clear()
