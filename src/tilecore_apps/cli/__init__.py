"""The `tilecore` command: thin drivers over the public API (`tilecore --help`)."""

from ._main import main as main

__all__ = ["main"]
