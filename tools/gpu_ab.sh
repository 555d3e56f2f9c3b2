#!/usr/bin/env bash
# The training step of the working tree against another revision's, on one GPU, in one call
# to the device machine (both on the same card, alternating, so the comparison holds on a
# noisy or unknown machine):
#
#   bash tools/gpu_ab.sh export REV              # here: REV's src/ into ab-base/src
#   bash tools/gpu_ab.sh run OUT_DIR [BATCH...]  # there (default batch 65536 4096)
#
# `export` leaves ab-base/ untracked (not ignored: it travels with the working tree); delete
# it afterwards. `run` needs the machine's python3 with a CUDA build of JAX (tilecore from
# src/ on PYTHONPATH, as tools/gpu_checks.sh) and writes OUT_DIR/step-{base,new}-BATCH-K.json
# (`tilecore bench step --workload criteo26 --no-naive`, K = 1, 2), OUT_DIR/ab.log and a
# table of both sides' medians. The results of 2026-11-28 (benchmarks/README.md, "On a
# GPU") came from the same comparison.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-}" in
  export)
    rev="${2:?usage: bash tools/gpu_ab.sh export REV}"
    rm -rf ab-base && mkdir -p ab-base && git archive "$rev" src | tar -x -C ab-base
    echo "ab-base/src: $(git rev-parse --short "$rev")"
    ;;
  run)
    out="${2:?usage: bash tools/gpu_ab.sh run OUT_DIR [BATCH...]}"
    shift 2
    [[ -d ab-base/src ]] || { echo "no ab-base/src: run 'bash tools/gpu_ab.sh export REV' first"; exit 2; }
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1
    for batch in "${@:-65536 4096}"; do
      for round in 1 2; do
        for side in base new; do
          src="$PWD/src"; [[ $side == base ]] && src="$PWD/ab-base/src"
          echo "=== $side, batch $batch, round $round" | tee -a "$out/ab.log"
          PYTHONPATH="$src" timeout 120 "${PYTHON:-python3}" -c \
            'import sys; from tilecore_apps.cli import main; sys.exit(main())' bench step \
            --workload criteo26 --no-naive --batch-size "$batch" --repeats 20 \
            --json "$out/step-$side-$batch-$round.json" >>"$out/ab.log" 2>&1
          echo "=== exit $?" | tee -a "$out/ab.log"
        done
      done
    done
    "${PYTHON:-python3}" - "$out" <<'EOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("step-*.json")):
    d = json.loads(f.read_text())
    print(f"{f.stem:22s} forward {d['forward_ms']:7.2f} ms  step {d['step_ms']:7.2f} ms  "
          f"{d['examples_per_s'] / 1e6:6.2f} M examples/s  ({d['device_kind']})")
EOF
    ;;
  *) echo "usage: bash tools/gpu_ab.sh export REV | run OUT_DIR [BATCH...]"; exit 2 ;;
esac
