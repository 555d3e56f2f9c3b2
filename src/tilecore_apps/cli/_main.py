"""Entry point of the `tilecore` command."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence

import tilecore as tc

from .. import bench
from . import _data, _demo, _limits, _train


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `tilecore` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="tilecore",
        description="SparseCore-style sharded embeddings on any JAX backend.",
    )
    parser.add_argument("--version", action="version", version=f"tilecore {tc.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{train,data,demo,bench,limits}")
    _train.add_parser(subparsers)
    _data.add_parser(subparsers)
    _demo.add_parser(subparsers)
    bench.add_parser(subparsers)
    _limits.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `tilecore` with `argv` (default: the command line); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = warnings.formatwarning
    warnings.formatwarning = _plain_warnings(f"tilecore {args.command}", previous)
    try:
        return args.run(args)
    except (ValueError, OSError, MemoryError) as error:  # bad options or inputs, or a file the file system
        # refuses (permissions, a full disk; its error names the path): a message, not a traceback
        print(f"tilecore {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which stops cleanly itself)
        print(f"tilecore {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = previous


def _plain_warnings(prefix: str, previous: Callable[..., str]) -> Callable[..., str]:
    """`warnings.formatwarning` that prints tilecore's own warnings (bad rows skipped, IDs
    dropped) as `prefix: warning: message` lines, without the library's file name and
    source line; other warnings as before."""

    def format_warning(message: Warning | str, category: type[Warning], filename: str,
                       lineno: int, line: str | None = None) -> str:
        if category.__module__.split(".")[0] == "tilecore":
            return f"{prefix}: warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    return format_warning
