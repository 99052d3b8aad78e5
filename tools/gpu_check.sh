#!/usr/bin/env bash
# One call on the device machine: the GPU tests, the cost of index bounding, and the
# kernel benchmarks. Logs and JSON go under $OUT (default ./gpu_out). Usage:
#   bash tools/gpu_check.sh [all|tests|bounds|bench]... [-- benchmark module names...]
# "bounds" times the public ops with this tree and with the tree in .baseline/ (copy
# the code before a change there: git archive <rev> cpsparse | tar -x -C .baseline).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export OUT PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do steps+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#steps[@]} -eq 0 ] && steps=(all)
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
if want bounds && [ -d .baseline/cpsparse ]; then
    echo "== bounds: before (.baseline) and after (this tree)"
    rm -f "$OUT"/bounds_before.json "$OUT"/bounds_after.json
    { for round in 1 2; do
          (cd .baseline && PYTHONPATH=$PWD:$PYTHONPATH python3 -m benchmarks.bench_bounds --tag before) \
              && python3 -m benchmarks.bench_bounds --tag after || exit 1
      done
      python3 -m benchmarks.bench_bounds --compare; } 2>&1 | tee "$OUT/bounds.log" | tail -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want tests; then
    python3 -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$OUT/gpu_tests.xml" \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
    mods=("$@")
    if [ ${#mods[@]} -eq 0 ]; then
        mods=($(cd benchmarks && ls bench_*.py 2>/dev/null | sed 's/\.py$//' | grep -v '^bench_bounds$'))
    fi
    for m in "${mods[@]}"; do
        echo "== benchmarks.$m"
        python3 -m "benchmarks.$m" 2>&1 | tee "$OUT/$m.log" | tail -30
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
fi
exit $status
