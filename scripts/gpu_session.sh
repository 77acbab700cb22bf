#!/usr/bin/env bash
# Everything a GPU session measures, in one call on the GPU machine, from the repo root, with $OUT set.
#
# Lane A (GPU 0): the GPU tests, then the benchmark of record (S1-S3 side by side with FAISS and torch, ceilings),
# then Parquet-to-Parquet on S1 (e2e4: on S4; profile: where exact mode's fused path spends its time).
# Lane B (GPU 1 when there are two, else after lane A on GPU 0): the engine's self-check, re-scoring sweep (S5),
# S5/S7, S4 and adversarial S1 against FAISS and torch, tuning runs for S2 and S3.
# Then, with two GPUs, the nightly batch job on one GPU and on both (scripts/gpu_batch.sh).
# Each step has its own time limit, so a slow step cannot eat the others; at most 8 files come back under $OUT.
# Knobs: LANE_A_STEPS (default "tests main e2e"), LANE_B_STEPS (default "doctor rescore s5s7 s4 adversarial tune"),
# any step in either lane (see run_step), RUN_BATCH=1.
set -u -o pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1
if [ -f .device/faiss-gpu-setup.sh ] && [ ! -f /tmp/faiss_env.sh ]; then
    bash .device/faiss-gpu-setup.sh >/tmp/faiss-setup.log 2>&1 || echo "FAISS GPU setup failed (see /tmp/faiss-setup.log)"
fi
[ -f /tmp/faiss_env.sh ] && source /tmp/faiss_env.sh
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
LANE_B_STEPS=${LANE_B_STEPS:-"doctor rescore s5s7 s4 adversarial tune"}
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS; echo "== $name"; timeout "$limit" "$@"; local rc=$?
         echo "== $name: rc $rc, $((SECONDS - t0)) s"; }
bench() { local dir=$1 limit=$2; shift 2; step "bench $dir: $*" "$limit" python3 -m recall bench --device gpu --out "/tmp/$dir" "$@" \
    >"/tmp/$dir.log" 2>&1; grep -E "^\| |^- " "/tmp/$dir/results.md" 2>/dev/null || tail -n 20 "/tmp/$dir.log"; }

# Any step may go in either lane.
run_step() {
    case $1 in
        tests) step "gpu tests" "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider \
                   --continue-on-collection-errors >"$OUT/tests.log" 2>&1
               tail -n 1 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20 ;;
        main) bench main "${MAIN_TIMEOUT:-260}" -w S1 -w S2 -w S3 --ceilings --repeat 3
              mkdir -p "$OUT/main"; cp /tmp/main/results.json "$OUT/main/" 2>/dev/null ;;  # the table is in the log
        e2e) bench e2e 120 -w S1 --e2e --contenders recall --repeat 2 ;;
        e2e4) bench e2e4 300 -w S4 --e2e --contenders recall --repeat 1 ;;
        s5s7) bench s5s7 150 -w S5 -w S7 --repeat 3 ;;
        profile) for kind in clustered adversarial; do
                     step "fused profile $kind" 120 env PROFILE_KIND=$kind python3 scripts/gpu_fused_profile.py
                 done ;;
        doctor) step doctor 90 python3 -m recall doctor ;;
        rescore) step "rescore sweep" 150 env -u OUT python3 scripts/gpu_rescore_sweep.py ;;
        sweep) step "selection overhead" 150 env SMOKE_SKIP_CHECKS=1 SMOKE_KIND=clustered SMOKE_TILES=2048,8192,4 \
                   SMOKE_GRAPHS=1 SMOKE_PRECISIONS=exact,fast python3 scripts/gpu_smoke.py ;;
        s4) bench s4 240 -w S4 --repeat 1 ;;
        adversarial) bench adv 150 -w S1 --kind adversarial --repeat 1 ;;
        tune) for shape in "128 100" "64 1000"; do set -- $shape
                  step "tune d=$1 k=$2" 150 python3 -m recall tune --device gpu --users 100000 --items 1000000 \
                      --dim "$1" --k "$2" --repeat 1; done ;;
        *) echo "unknown step $1" ;;
    esac
}
lane_a() { for s in ${LANE_A_STEPS:-tests main e2e}; do run_step "$s"; done; }
lane_b() { for s in $LANE_B_STEPS; do run_step "$s"; done; }

if [ "$GPUS" -ge 2 ]; then
    (CUDA_VISIBLE_DEVICES=0 lane_a) >"$OUT/lane_a.log" 2>&1 &
    a=$!
    CUDA_VISIBLE_DEVICES=1 lane_b >"$OUT/lane_b.log" 2>&1
    wait $a
else
    lane_a >"$OUT/lane_a.log" 2>&1
    lane_b >"$OUT/lane_b.log" 2>&1
fi
cat "$OUT/lane_a.log"
grep -E "^==|^\| (S|s|recall|faiss|torch)|TB/s|best|PASS|FAIL|cold|tuned" "$OUT/lane_b.log"
if [ "$GPUS" -ge 2 ] && [ "${RUN_BATCH:-1}" = 1 ] && [ -f scripts/gpu_batch.sh ]; then
    step "2-GPU tests" 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed.py tests/test_batch.py
    step "batch on 1 and 2 GPUs" "${BATCH_TIMEOUT:-300}" env USERS="${BATCH_USERS:-1000000}" bash scripts/gpu_batch.sh
fi
