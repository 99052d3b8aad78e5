#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over a small GPU
# test subset that launches every kernel. Logs under $OUT. Usage: bash tools/sanitize.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SUBSET=${SANITIZE_TESTS:-tests/test_gpu_smoke.py}
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check no)
    timeout "${SANITIZE_TIMEOUT:-75}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 --print-limit 20 \
        python3 -m pytest "$SUBSET" -q -p no:cacheprovider -x > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    errors=$(grep -Eo "(ERROR|RACECHECK) SUMMARY: .*" "$OUT/sanitize_$tool.log" | tail -1)
    echo "$tool: exit $rc, ${errors:-no summary}"
    [ "$rc" -eq 0 ] || status=1
done
exit $status
