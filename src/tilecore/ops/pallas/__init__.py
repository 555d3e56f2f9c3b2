"""The Pallas wing: GPU kernels written in Pallas for the Triton backend.

Today one kernel, the sorted-segment gather and combine (`_segments`): entries
sorted by segment, then one program per block of output rows gathers their rows of
values and sums `gain · row` in float32 registers. It pools the lookup (table rows
per sample) and sums the update's gradients per distinct row (gradient rows per
table row); everything else (the optimizer, routing over a mesh, the minibatch
layout) is the XLA wing's.

Opt-in only: `$TILECORE_KERNELS=pallas` on a GPU backend (Triton compiles the
kernels), `pallas-interpret` on any backend (Pallas's interpreter: the same kernel
body run as XLA ops, slow; the tests use it on CPU against the numpy oracle). `auto`
never picks this wing: timed on an NVIDIA H200 (criteo26, Adagrad) its step took 10.0 ms
against XLA's 1.6 ms at batch 4096, and 180.7 ms against 7.9 ms at batch 65536, where
its per-row sums serialise on the hot rows of Zipf tables (a program loops as long as
its block's longest segment). Its block sizes are first guesses, not tuned. Benchmark::

    TILECORE_KERNELS=pallas tilecore bench step --workload criteo26 --no-naive
    TILECORE_KERNELS=xla    tilecore bench step --workload criteo26 --no-naive
"""

from ._wing import pallas_wing as pallas_wing

__all__ = ["pallas_wing"]
