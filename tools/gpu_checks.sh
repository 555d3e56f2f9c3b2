#!/usr/bin/env bash
# The GPU checks of issue 13, as one prepared script for a machine with an NVIDIA GPU
# and its own CUDA build of JAX (no network, no venv of ours: the system python3 with
# its jax, flax, optax, orbax, numba, pyarrow, pytest; tilecore from src/ on PYTHONPATH).
#
#   bash tools/gpu_checks.sh OUT_DIR [SECONDS]   # stops starting steps after SECONDS (540)
#
# Writes OUT_DIR/gpu-checks.log and one JSON file per benchmark (about 20 files: tar
# them where only a few files come back), most wanted first, each figure beside its
# baseline in the same run, so a run cut short still answers the first questions:
#   1. the step with the XLA and the Pallas wing (float32) at batch 4096 and 65536:
#      forward and update bytes/s against the device's copy bandwidth; and at 65536 with
#      the tables in 7 stacks instead of 26 (--activation-mem-mb 32);
#   2. device against host preprocessing, at both batch sizes;
#   3. the tests (do the CPU-proved paths hold on the GPU: device preprocessing
#      bit-identical to the host's, the Pallas kernels compiled by Triton, half tables,
#      the ops against the numpy oracle);
#   4. the end-to-end step at batch 65536, host input processes and device preprocessing;
#   5. device time per kernel of the step and of device preprocessing (profiles);
#   6. bfloat16 tables on both wings; host preprocessing IDs/s on 1-16 threads; step time
#      against vocabulary and IDs per batch (JSON + PNG).
# First run (NVIDIA H200, 2026-11-27): about 6 minutes; results and their reading in
# benchmarks/README.md ("On a GPU").
set -uo pipefail
out="${1:?usage: bash tools/gpu_checks.sh OUT_DIR [SECONDS]}"
budget="${2:-540}"
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the test workers share the one GPU
py="${PYTHON:-python3}"
log="$out/gpu-checks.log"

step() {  # step SECONDS NAME COMMAND...: run it under a limit (cut to the budget left)
  local limit=$1 name=$2 left=$((budget - SECONDS))
  shift 2
  if ((left < 20)); then
    echo "=== $name: skipped, ${left} s of the budget left" | tee -a "$log"
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit $limit s)" | tee -a "$log"
  local began=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local status=${PIPESTATUS[0]}
  echo "=== $name: exit $status in $((SECONDS - began)) s" | tee -a "$log"
}

tilecore=("$py" -c 'import sys; from tilecore_apps.cli import main; sys.exit(main())')
bench_step() {  # bench_step KERNELS DTYPE BATCH [ACTIVATION_MEM_MB]
  local stacking=() name="$1-$2-$3"
  [[ -n "${4:-}" ]] && stacking=(--activation-mem-mb "$4") && name="$name-mem$4"
  step 75 "bench step ($1, $2, batch $3${4:+, $4 MiB per SparseCore})" env TILECORE_KERNELS="$1" \
    "${tilecore[@]}" bench step --workload criteo26 --no-naive --weights-dtype "$2" \
    --batch-size "$3" --repeats 20 "${stacking[@]}" --json "$out/step-$name.json"
}
preprocess() {  # preprocess BATCH THREADS NAME [--device]
  step 60 "bench preprocess ($3)" "${tilecore[@]}" bench preprocess --workload criteo26 \
    --topology 1x1 --batch-size "$1" --threads "$2" --repeats 10 "${@:4}" \
    --json "$out/preprocess-$3.json"
}

step 30 "machine" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
  --format=csv; nproc; $py -c 'import jax, numba, numpy; print(\"jax\", jax.__version__, \
  \"numba\", numba.__version__, \"numpy\", numpy.__version__, jax.devices())'"
cores=$(nproc)
for batch in 4096 65536; do
  bench_step xla float32 $batch
  bench_step pallas float32 $batch
done
# criteo26 at batch 65536 in 7 stacks (as at 4096) instead of 26: fewer, larger kernels
bench_step xla float32 65536 32
preprocess 4096 "$cores" device-4096 --device
preprocess 65536 "$cores" device-65536 --device
step 150 "tests on the GPU" "$py" -m pytest -q -p no:cacheprovider -p no:benchmark -n 4 -rfE \
  tests/test_ops_pallas.py tests/test_device_preprocessing.py tests/test_ops_half.py \
  tests/test_ops.py
step 100 "bench train (batch 65536, host, $((cores - 2)) input processes)" "${tilecore[@]}" \
  bench train --batch-size 65536 --steps 40 --repeats 2 --input-processes $((cores - 2)) \
  --json "$out/train-65536-host.json"
step 60 "bench train (batch 65536, device preprocessing)" "${tilecore[@]}" bench train \
  --batch-size 65536 --steps 30 --repeats 1 --preprocess-on device \
  --json "$out/train-65536-device.json"
step 60 "profile: step (xla, batch 65536)" "$py" tools/profile_kernels.py \
  "$out/profile-step-65536.json" -- bench step --workload criteo26 --no-naive \
  --batch-size 65536 --repeats 3 --warmup 1 --batches 1
step 60 "profile: device preprocessing (batch 65536)" "$py" tools/profile_kernels.py \
  "$out/profile-preprocess-65536.json" -- bench preprocess --workload criteo26 --topology 1x1 \
  --device --batch-size 65536 --repeats 3 --warmup 1 --batches 1
bench_step xla bfloat16 65536
bench_step pallas bfloat16 65536
for threads in 1 2 4 8 16; do
  preprocess 65536 "$threads" "threads-$threads"
done
step 90 "bench scale" "${tilecore[@]}" bench scale --repeats 5 \
  --json "$out/scale.json" --plot "$out/scale.png"
echo "=== done in $SECONDS s" | tee -a "$log"
