#!/usr/bin/env bash
# The GPU checks of issue 13, as one prepared script for a machine with an NVIDIA GPU
# and its own CUDA build of JAX (no network, no venv of ours: the system python3 with
# its jax, flax, optax, orbax, numba, pyarrow, pytest; tilecore from src/ on PYTHONPATH).
#
#   bash tools/gpu_checks.sh OUT_DIR        # about 9 minutes; every step has its own limit
#
# Writes OUT_DIR/gpu-checks.log and one JSON file per benchmark. The tests first (do the
# CPU-proved paths hold on the GPU: device preprocessing bit-identical to the host's,
# the Pallas kernels compiled by Triton, half tables, the ops against the numpy oracle),
# then the figures the issue asks for, each beside its baseline in the same run:
# the step with the XLA and the Pallas wing (float32 and bfloat16), device against host
# preprocessing, and the end-to-end step at batch 65536.
set -uo pipefail
out="${1:?usage: bash tools/gpu_checks.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
log="$out/gpu-checks.log"

step() {  # step SECONDS NAME COMMAND...: run it under a limit, log its status, go on
  local limit=$1 name=$2
  shift 2
  echo "=== $name" | tee -a "$log"
  local began=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local status=${PIPESTATUS[0]}
  echo "=== $name: exit $status in $((SECONDS - began)) s" | tee -a "$log"
}

tilecore=("$py" -c 'import sys; from tilecore_apps.cli import main; sys.exit(main())')

step 30 "machine" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv; $py -c 'import jax; print(jax.__version__, jax.devices())'"
step 240 "tests on the GPU" "$py" -m pytest -q -p no:cacheprovider \
  tests/test_device_preprocessing.py tests/test_ops_pallas.py tests/test_ops_half.py \
  tests/test_ops.py
for kernels in xla pallas; do
  for dtype in float32 bfloat16; do
    step 60 "bench step ($kernels, $dtype)" env TILECORE_KERNELS="$kernels" "${tilecore[@]}" bench step \
      --workload criteo26 --no-naive --weights-dtype "$dtype" \
      --json "$out/step-$kernels-$dtype.json"
  done
done
step 60 "bench preprocess (host and device)" "${tilecore[@]}" bench preprocess --workload criteo \
  --topology 1x4 --device --json "$out/preprocess-device.json"
step 120 "bench train (batch 65536)" "${tilecore[@]}" bench train \
  --batch-size 65536 --steps 50 --repeats 2 --input-processes 6 --json "$out/train-65536.json"
