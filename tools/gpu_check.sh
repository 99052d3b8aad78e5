#!/usr/bin/env bash
# One call on the device machine: every GPU test, then every benchmark.
# Logs and JSON go under $OUT (default ./gpu_out). Usage:
#   bash tools/gpu_check.sh [tests|bench|all] [benchmark module names...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
what=${1:-all}; shift || true
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$OUT/gpu_tests.xml" \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    mods=("$@")
    if [ ${#mods[@]} -eq 0 ]; then
        mods=($(cd benchmarks && ls bench_*.py 2>/dev/null | sed 's/\.py$//'))
    fi
    for m in "${mods[@]}"; do
        echo "== benchmarks.$m"
        python3 -m "benchmarks.$m" 2>&1 | tee "$OUT/$m.log" | tail -30
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
fi
exit $status
