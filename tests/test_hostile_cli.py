"""The commands given hostile values: each is refused at once with one line naming the flag
and its value, before the work it would spoil (or, for a peer that misbehaves, as soon as
it does), never a traceback, a hang or a machine's memory filled."""

from __future__ import annotations

import pytest

from tilecore_apps.cli import main


def test_bench_preprocess_warmup_message_states_its_bound(
        capsys: pytest.CaptureFixture[str]) -> None:
    """It said '--warmup must be >= 1' though 0 is accepted."""
    assert main(["bench", "preprocess", "--warmup", "-1"]) == 2
    assert "bench preprocess: --warmup must be >= 0, got -1." in capsys.readouterr().err
    assert main(["bench", "preprocess", "--repeats", "0"]) == 2
    assert "bench preprocess: --repeats must be >= 1, got 0." in capsys.readouterr().err
