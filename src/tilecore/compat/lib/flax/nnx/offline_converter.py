"""The reference's offline checkpoint converter
(`jax_tpu_embedding.sparsecore.lib.flax.nnx.offline_converter`) on tilecore.

Re-lays an nnx checkpoint for another topology on the host::

    python -m tilecore.compat.lib.flax.nnx.offline_converter \\
        --input_checkpoint=/ckpt/run1 --output_checkpoint=/ckpt/run1_v6e_x8 \\
        --target_num_devices=8 --target_device_kind=TPU_v6e

Flags are the reference's (`--input_checkpoint`, `--output_checkpoint` required;
`--target_num_devices`, `--target_device_kind='TPU v5'`,
`--target_global_batch_size`), parsed with argparse because absl is not a
tilecore dependency: `--flag=value`, `--flag value` and absl's single-dash
`-flag=value` all work. Without `--target_num_devices` the tables are only
unstacked. SparseCores per device follow the device kind
(`compat.utils.utils.num_sparsecores_per_device`; '_' reads as ' ').
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ....utils.utils import num_sparsecores_per_device
from . import checkpoint_utils

_log = logging.getLogger(__name__)

__all__ = ["FakeDevice", "expand_directory_path", "main", "run_conversion"]

_TESTDIR = "TEST_UNDECLARED_OUTPUTS_DIR"
_DESCRIPTION = "Re-lay an nnx SparseCore checkpoint for another topology (offline, on the host)."


class FakeDevice:
    """A stand-in device of the target topology (only its kind and ids are read)."""

    def __init__(self, device_id: int, device_kind: str = "TPU v5") -> None:
        self.id = device_id
        self.process_index = 0
        self.slice_index = 0
        self.device_kind = device_kind
        self.platform = "tpu"
        self.memory_kind = "tpu_hbm"


def expand_directory_path(input_dir: str) -> str | None:
    """Absolute paths and URIs as given; `TEST_UNDECLARED_OUTPUTS_DIR[/sub]` under that
    environment variable (created); other relative paths resolved."""
    if input_dir is None:
        return None
    if input_dir.startswith("/") or "://" in input_dir:
        return input_dir
    if input_dir == _TESTDIR or input_dir.startswith(_TESTDIR + "/"):
        root = os.environ.get(_TESTDIR)
        if not root:
            raise ValueError(f"{_TESTDIR} environment variable is not set (needed by "
                             f"{input_dir!r}).")
        if input_dir == _TESTDIR:
            return root
        expanded = Path(root) / input_dir[len(_TESTDIR) + 1:]
        expanded.mkdir(parents=True, exist_ok=True)
        return os.fspath(expanded)
    return os.fspath(Path(input_dir).resolve())


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offline_converter", description=_DESCRIPTION)

    def flag(name: str, **kwargs: object) -> None:
        parser.add_argument(f"--{name}", f"-{name}", dest=name, **kwargs)  # type: ignore[arg-type]

    flag("input_checkpoint", required=True,
         help="Path to the input checkpoint directory to convert.")
    flag("output_checkpoint", required=True,
         help="Path to the output checkpoint directory where converted checkpoint is saved.")
    flag("target_num_devices", type=_positive, default=None,
         help="Number of devices in the target topology. If not provided, checkpoint tables "
              "will only be unstacked and unsharded without restacking for a target topology.")
    flag("target_device_kind", default="TPU v5", help="Device kind of the target topology.")
    flag("target_global_batch_size", type=_positive, default=None,
         help="Optional target global batch size for the target topology.")
    return parser


def parse_flags(argv: Sequence[str]) -> argparse.Namespace:
    """The converter's flags from `argv` (absl style: `argv[0]`, if not a flag, is the program)."""
    args = list(argv)
    if args and not args[0].startswith("-"):
        args = args[1:]
    return _parser().parse_args(args)


def run_conversion(flags: argparse.Namespace | None = None) -> None:
    """Convert the checkpoint the flags name (None: parse `sys.argv`)."""
    flags = parse_flags(sys.argv) if flags is None else flags
    target = None
    if flags.target_num_devices is not None:
        devices = [FakeDevice(i, device_kind=flags.target_device_kind.replace("_", " "))
                   for i in range(flags.target_num_devices)]
        target = checkpoint_utils.TargetTopology(
            num_global_devices=len(devices),
            num_sc_per_device=num_sparsecores_per_device(devices[0]),
            device_kind=devices[0].device_kind)
    input_path = expand_directory_path(flags.input_checkpoint)
    if input_path is not None and input_path.endswith(".tgz"):
        input_path = checkpoint_utils.decompress_checkpoint(input_path)
    checkpoint_utils.convert_cross_topology_checkpoint(
        input_checkpoint_path=input_path,
        output_checkpoint_path=expand_directory_path(flags.output_checkpoint),
        target_topology=target, target_batch_size=flags.target_global_batch_size)
    _log.info("Exiting cleanly after offline cross-topology checkpoint conversion.")


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry: parse `argv` (None: `sys.argv`) and convert."""
    run_conversion(parse_flags(sys.argv if argv is None else argv))


if __name__ == "__main__":
    main()
