#!/usr/bin/env bash
# One call on the device machine: the GPU tests, the cost of index bounding, the host-time
# profile, the kernel benchmarks and the side-by-side peer benchmark. Logs and JSON go
# under $OUT (default ./gpu_out). Usage:
#   bash tools/gpu_check.sh [all|tests|bounds|profile|layer|bench|peers|ncu|ab|landing|dgbits]... [-- arguments...]
# "profile" is the host-time profile, the layer forward by stage ("layer" alone runs only
# that), the attention kernel's ablations and trace, the top-k kernel's phase trace and its
# times on the scoring kernel's logits (profile_topk logits).
# "ncu" (only when named: not part of "all") runs Nsight Compute on the
# warp-specialized decode scoring kernels (benchmarks/profile_indexer.py):
# the section summary, then the stall samples instruction by instruction (ncu_source.*).
# "bounds" times the public ops with this tree and with the tree in .baseline/ (copy
# the code before a change there: git archive <rev> cpsparse | tar -x -C .baseline).
# "landing" (only when named) is benchmarks/probe_page_landing.py --check: when each page of
# a B=1 decode stage lands, copied by cp.async or by TMA.
# "dgbits" (only when named) is benchmarks/probe_deepgemm_bits.py: the indexer logits
# against DeepGEMM's bit for bit (it waits for the peers' build).
# "ab" (only when named: not part of "all") is the A/B of a kernel change: bench_peers,
# with the arguments after "--" (e.g. -- --rounds 2 --only indexer_decode), on the tree in
# .baseline/ (its own benchmarks: git archive <rev> cpsparse benchmarks | tar -x -C
# .baseline), then on this tree, each against the peer in its own process, then
# bench_peers --compare (kernel medians, and each side's speedup over its peer).
# "bench" takes benchmark module names after "--"; "peers" passes them to bench_peers
# (e.g. -- --only mla_decode). The peers (DeepGEMM, FlashMLA) build in the background
# from .peers/ (copied from shared/peers/, carried) while the tests run; the build
# stays in /tmp/peers for later calls of the same lease.
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
# (the steps "all" does not include: only when named)
named() { for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
status=0
PEERS_DIR=/tmp/peers
if { want peers || named ab || named dgbits; } && [ -f .peers/build.sh ] && [ ! -s "$PEERS_DIR/built" ] && ! pgrep -f "build.sh .peers" > /dev/null; then
    echo "== peers: building in the background (log $OUT/peers_build.log)"
    setsid bash .peers/build.sh .peers/peers.tar.xz "$PEERS_DIR" > "$OUT/peers_build.log" 2>&1 < /dev/null &
fi
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
    # A kernel that deadlocks (a named barrier or a setmaxnreg split gone wrong) would
    # otherwise hold the machine until the call's limit: the suite takes ~110 s.
    timeout "${GPU_TESTS_TIMEOUT:-360}" \
        python3 -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$OUT/gpu_tests.xml" \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want profile || want layer; then
    # Where a DeepseekV32MLA forward's time goes, stage by stage (the scenarios' forwards
    # cost far more than their ops): writes profile_layer.{txt,json} too.
    timeout 300 python3 -m benchmarks.profile_layer > "$OUT/profile_layer.log" 2>&1 || status=1
    grep -E "^(====|  [a-z])" "$OUT/profile_layer.log" | head -70
fi
if want profile; then
    python3 -m benchmarks.profile_host > "$OUT/profile_host.log" 2>&1 || status=1
    head -40 "$OUT/profile_host.log"
    # Where the fp8 decode kernel's time goes (source ablations, see the module).
    timeout 300 python3 -m benchmarks.profile_attention 2>&1 | tee "$OUT/profile_attention.log" \
        | tail -30
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # The MODEL1 kernel's ablations (its producer's loads, the products).
    timeout 300 python3 -m benchmarks.profile_attention model1 2>&1 \
        | tee "$OUT/profile_attention_model1.log" | tail -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # The ping-pong prefill kernel's ablations (its copies, its products, its masks).
    timeout 200 python3 -m benchmarks.profile_attention prefill 2>&1 \
        | tee "$OUT/profile_attention_prefill.log" | tail -10
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # ... and which side of the pipeline waits for which (clock64 stamps a tile).
    timeout 120 python3 -m benchmarks.profile_attention trace 2>&1 \
        | tee "$OUT/profile_attention_trace.log" | tail -10
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # The ws decode scoring kernel's first item, CTA by CTA (clock64 stamps): B=1 x 32K,
    # where a launch is its start-up, and B=64 x 32K.
    { timeout 120 python3 -m benchmarks.profile_indexer trace 1 32768 1 \
          && timeout 120 python3 -m benchmarks.profile_indexer trace 64 32768 1; } 2>&1 \
        | tee "$OUT/profile_indexer_trace.log" | tail -4
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # The top-k kernel's phases (clock64 stamps a CTA), normal and low-contrast rows.
    timeout 200 python3 -m benchmarks.profile_topk 2>&1 | tee "$OUT/profile_topk.log" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # The decode top-k on the paged scoring kernel's own logits (and normal, student-t rows).
    timeout 200 python3 -m benchmarks.profile_topk logits 2>&1 \
        | tee "$OUT/profile_topk_logits.log" | tail -16
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if named ncu; then
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    if [ -x "$NCU" ]; then
        echo "== ncu: the ws decode scoring kernels (report $OUT/ncu_indexer.txt)"
        timeout 300 "$NCU" --clock-control none -k regex:_ws_h64n --section SpeedOfLight \
            --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
            python3 -m benchmarks.profile_indexer > "$OUT/ncu_indexer.txt" 2>&1 || status=1
        python3 -m benchmarks.profile_indexer --parse "$OUT/ncu_indexer.txt" || status=1
        echo "== ncu: the same kernels instruction by instruction (source page $OUT/ncu_source.csv)"
        timeout 200 "$NCU" --clock-control none -k regex:_ws_h64n --section SourceCounters \
            --section WarpStateStats -f -o "$OUT/ncu_source" python3 -m benchmarks.profile_indexer \
            > "$OUT/ncu_source.log" 2>&1 || status=1
        "$NCU" --import "$OUT/ncu_source.ncu-rep" --page source --csv --print-source sass \
            > "$OUT/ncu_source.csv" 2>> "$OUT/ncu_source.log" || status=1
        rm -f "$OUT/ncu_source.ncu-rep"
        python3 -m benchmarks.profile_indexer --source "$OUT/ncu_source.csv" | tee "$OUT/ncu_source.txt" || status=1
    else
        echo "== ncu: not found on this machine, skipped"
    fi
fi
if named landing; then
    # When each page of a B=1 decode stage lands, by cp.async and by TMA (a diagnostic).
    timeout 120 python3 -m benchmarks.probe_page_landing --check 2>&1 \
        | tee "$OUT/probe_page_landing.log" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if named dgbits; then
    timeout 420 python3 -m benchmarks.probe_deepgemm_bits --peers-dir "$PEERS_DIR" 2>&1 \
        | tee "$OUT/probe_deepgemm_bits.log" | tail -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
    mods=("$@")
    if [ ${#mods[@]} -eq 0 ]; then
        mods=($(cd benchmarks && ls bench_*.py 2>/dev/null | sed 's/\.py$//' | grep -v -e '^bench_bounds$' -e '^bench_peers$'))
    fi
    for m in "${mods[@]}"; do
        echo "== benchmarks.$m"
        python3 -m "benchmarks.$m" 2>&1 | tee "$OUT/$m.log" | tail -30
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
fi
if want peers; then
    # bench_peers waits for the build, puts the peers on sys.path and preloads
    # libstdc++ for DeepGEMM's JIT itself.
    echo "== benchmarks.bench_peers"
    python3 -m benchmarks.bench_peers --peers-dir "$PEERS_DIR" "$@" 2>&1 \
        | tee "$OUT/bench_peers.log" | tail -60
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    cp "$PEERS_DIR"/*.log "$OUT/" 2>/dev/null
fi
if named ab; then
    if [ -d .baseline/cpsparse ] && [ -d .baseline/benchmarks ]; then
        echo "== ab: benchmarks.bench_peers $* on .baseline, then on this tree"
        mkdir -p "$OUT/ab_base" "$OUT/ab_new"
        (cd .baseline && OUT="$OUT/ab_base" PYTHONPATH=$PWD python3 -m benchmarks.bench_peers \
            --peers-dir "$PEERS_DIR" "$@") > "$OUT/ab_base.log" 2>&1 || status=1
        OUT="$OUT/ab_new" python3 -m benchmarks.bench_peers --peers-dir "$PEERS_DIR" "$@" \
            > "$OUT/ab_new.log" 2>&1 || status=1
        python3 -m benchmarks.bench_peers --compare "$OUT/ab_base/peers.json" \
            "$OUT/ab_new/peers.json" 2>&1 | tee "$OUT/ab.txt" || status=1
    else
        echo "== ab: .baseline/ lacks cpsparse/ or benchmarks/ (git archive <rev> cpsparse" \
             "benchmarks | tar -x -C .baseline): skipped"
        status=1
    fi
fi
# The device tool brings back at most 8 files from $OUT, subfolders' (the ab step's
# ab_base/, ab_new/) included: past that, everything goes into one archive and the main
# results stay beside it.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && tar -czf ../gpu_check_all.tgz --exclude=gpu_check_all.tgz . \
        && find . -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} + \
        && find . -maxdepth 1 -type f ! -name peers.json ! -name gpu_tests.log \
            ! -name bench_peers.log ! -name ab.txt -delete && mv ../gpu_check_all.tgz .)
    echo "== $OUT: more than 8 files, all of them in gpu_check_all.tgz"
fi
exit $status
