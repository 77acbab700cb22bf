#!/usr/bin/env bash
# Everything a GPU session measures, in one call on the GPU machine, from the repo root, with $OUT set:
# GPU tests, the engine's self-check, a tiling sweep, the benchmark of record (S1-S3 side by side with FAISS and
# torch, ceilings measured), S5/S7, Parquet-to-Parquet, and a tuning run. Each step has its own time limit, so a slow
# step cannot eat the others; at most 8 files come back under $OUT (plots are left out).
set -u -o pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1
if [ -f .device/faiss-gpu-setup.sh ] && [ ! -f /tmp/faiss_env.sh ]; then
    bash .device/faiss-gpu-setup.sh >/tmp/faiss-setup.log 2>&1 || echo "FAISS GPU setup failed (see /tmp/faiss-setup.log)"
fi
[ -f /tmp/faiss_env.sh ] && source /tmp/faiss_env.sh
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@"; echo "== $name: rc $?"; }

step "gpu tests" "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider >"$OUT/tests.log" 2>&1
tail -n 1 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
bench() { local dir=$1 limit=$2; shift 2; step "bench $*" "$limit" python3 -m recall bench --device gpu --out "/tmp/$dir" "$@" \
    >"/tmp/$dir.log" 2>&1; mkdir -p "$OUT/$dir"; cp "/tmp/$dir/results.md" "$OUT/$dir/" 2>/dev/null || tail -n 20 "/tmp/$dir.log";
    cat "$OUT/$dir/results.md" 2>/dev/null | grep -E "^\| S|^- " ; }
bench main "${MAIN_TIMEOUT:-240}" -w S1 -w S2 -w S3 --ceilings --repeat 3
cp /tmp/main/results.json "$OUT/main/" 2>/dev/null
bench s5s7 120 -w S5 -w S7 --repeat 3
step "doctor" 90 python3 -m recall doctor >"$OUT/doctor.log" 2>&1; tail -n 25 "$OUT/doctor.log"
step "sweep" 120 env SMOKE_SKIP_CHECKS=1 SMOKE_KIND="${SWEEP_KIND:-clustered}" SMOKE_TILES="${SWEEP_TILES:-2048,8192,4}" \
    SMOKE_GRAPHS=1 SMOKE_PRECISIONS=exact,fast python3 scripts/gpu_smoke.py >"$OUT/sweep.log" 2>&1
grep -vi warn "$OUT/sweep.log" | tail -n 8
bench e2e 90 -w S1 --e2e --contenders recall --repeat 2
step "tune S1" "${TUNE_TIMEOUT:-90}" python3 -m recall tune --device gpu --users 100000 --items 1000000 --dim 64 --k 100 --repeat 1 \
    >"$OUT/tune.log" 2>&1; tail -n 25 "$OUT/tune.log"
