#!/usr/bin/env bash
# The one script a GPU machine runs, from the project root:   OUT=/some/folder bash scripts/gpu_run.sh
#
# 1. FAISS with GPU support: sources /tmp/faiss_env.sh when it exists; otherwise, when the staged .device/ folder came
#    along with the working tree (see ../shared/device/README.md), runs its setup first. Without either, the FAISS GPU
#    contender is reported as skipped with its reason: nothing else changes.
# 2. The GPU tests:   PYTHONPATH=. python3 -m pytest -m gpu -q          -> $OUT/gpu-tests.log
# 3. The benchmark:   PYTHONPATH=. python3 -m recall bench --device gpu --ceilings --workload S1 ... --out $OUT/bench
#                                                                          -> $OUT/bench.log, $OUT/bench/results.*
# 4. Prints a short summary: test outcome and the results table.
#
# Knobs (environment): WORKLOADS="S1 S2 S3"  KIND=""(each workload's default)  CONTENDERS=recall,faiss,torch
#                      REPEAT=3  CEILINGS=1  RUN_TESTS=1  BENCH_ARGS=""(extra `recall bench` arguments, e.g. --e2e)
#                      TEST_TIMEOUT=240  BENCH_TIMEOUT=480 (seconds)
# Output: at most 6 files under $OUT, at most 2 folders deep (setup.log, gpu-tests.log, bench.log,
# bench/results.json, bench/results.md, bench/throughput.png). Exit status: non-zero if the tests or the bench failed.
set -u -o pipefail

: "${OUT:?set OUT to the output folder}"
WORKLOADS=${WORKLOADS:-"S1 S2 S3"}
KIND=${KIND:-}
CONTENDERS=${CONTENDERS:-recall,faiss,torch}
REPEAT=${REPEAT:-3}
CEILINGS=${CEILINGS:-1}
RUN_TESTS=${RUN_TESTS:-1}
BENCH_ARGS=${BENCH_ARGS:-}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-480}
mkdir -p "$OUT"
# An earlier run's files in the same $OUT would be reported below as this run's (its table when this bench fails,
# its test line when RUN_TESTS=0).
rm -f "$OUT/setup.log" "$OUT/gpu-tests.log" "$OUT/bench.log" "$OUT/bench/results.json" "$OUT/bench/results.md" \
    "$OUT/bench/throughput.png"

if [ ! -f /tmp/faiss_env.sh ] && [ -f .device/faiss-gpu-setup.sh ]; then
    bash .device/faiss-gpu-setup.sh >"$OUT/setup.log" 2>&1 || echo "FAISS GPU setup failed: see setup.log"
fi
if [ -f /tmp/faiss_env.sh ]; then
    # It prepends FAISS's folder to PYTHONPATH: the commands below add "." in front of it, not instead of it.
    # shellcheck disable=SC1091
    source /tmp/faiss_env.sh
fi

tests_rc=0
if [ "$RUN_TESTS" = 1 ]; then
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout "$TEST_TIMEOUT" python3 -m pytest -m gpu -q >"$OUT/gpu-tests.log" 2>&1
    tests_rc=$?
fi

args=(--device gpu --contenders "$CONTENDERS" --repeat "$REPEAT" --out "$OUT/bench")
for w in $WORKLOADS; do args+=(--workload "$w"); done
[ -n "$KIND" ] && args+=(--kind "$KIND")
[ "$CEILINGS" = 1 ] && args+=(--ceilings)
# shellcheck disable=SC2206
[ -n "$BENCH_ARGS" ] && args+=($BENCH_ARGS)
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout "$BENCH_TIMEOUT" python3 -m recall bench "${args[@]}" >"$OUT/bench.log" 2>&1
bench_rc=$?

echo "== gpu tests (rc $tests_rc): $(tail -n 1 "$OUT/gpu-tests.log" 2>/dev/null || echo 'not run')"
if [ "$tests_rc" != 0 ] && [ -f "$OUT/gpu-tests.log" ]; then
    grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 10
fi
echo "== recall bench ${args[*]} (rc $bench_rc)"
if [ -f "$OUT/bench/results.md" ]; then
    cat "$OUT/bench/results.md"
else
    tail -n 20 "$OUT/bench.log"
fi
grep -E "^(problem|error):" "$OUT/bench.log" | head -n 10
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
