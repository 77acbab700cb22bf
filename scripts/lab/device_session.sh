#!/usr/bin/env bash
# One call on the GPU machine, from the project root, with $OUT set: the steps named in STEPS, each under its own
# time limit, logs under $OUT (at most 8 files come back, 2 folders deep).
#
#   setup     FAISS (.device/) and cuVS (.device-cuvs/) staged by ../shared/device (skipped where absent)
#   tests     the GPU tests of this tree (pytest -m gpu)                                   -> $OUT/gpu-tests.log
#   sweep     scripts/lab/soundness_sweep.py --device gpu: random cells of hard data against the float64 oracle,
#             small (SWEEP_MINUTES, 2) then GPU-sized (SWEEP_LARGE_MINUTES, 2)               -> $OUT/sweep*.log
#   compare   `recall bench -w S1..S4 --contenders recall` (or COMPARE_ARGS) of the previous commit (.oldtree/,
#             carried) and of this tree, alternating, in one run                            -> $OUT/compare.log
#   early     scripts/lab/e2e_layouts.py: the S4 job with early searches on and off, two layouts -> $OUT/early.log
#   quick     `recall bench --matrix gpu-quick` with every contender                        -> $OUT/quick/results.*
#   filters   the exclusion and item-filter workloads with their anchors                    -> $OUT/filters.log
#   fastcells the gpu-quick cells where fast mode fell back, recall alone                    -> $OUT/fast/results.*
#   fastgrid  `recall bench --matrix gpu-fast` (FASTGRID_CELLS, FASTGRID_CONTENDERS)           -> $OUT/fastgrid/results.*
#   jobx      the S4-x20 job Parquet to Parquet (early searches with exclusions), once       -> $OUT/jobx.log
#   shards    scripts/lab/item_shards_gpu.py: item shards on one GPU against the unsharded job -> $OUT/shards.log
#   probe     scripts/lab/kernel_profile.py: the weak cells under option variants, per-kernel times -> $OUT/probe.log
#   latency   scripts/lab/embedded_latency.py: 1, 32 and 1,024 users against 1M items, every contender -> $OUT/latency.log
#   micro     scripts/lab/fused_h_micro.py: fast mode's fused kernel alone, at each of MICRO_WIDTHS (72 136 264) -> $OUT/micro.log
#   wcheck    scripts/lab/fused_w_check.py: Hopper's wgmma kernel against float64 products, then timed against
#             the mma.sync kernel, and each build of WCHECK_DEFINES against it              -> $OUT/fused_wN.log
#   ncu       Nsight Compute on both float16 fused kernels at S1's shape (scripts/lab/fused_ncu.py 72 262144 126)
#             and gpu-quick 19's (48 100000 1900), or NCU_SHAPES with NCU_KERNELS            -> $OUT/ncu-*.log
#   seeds     kernel_profile.py: the threshold sample's size (EngineOptions.seed_sample) on the user-heavy and
#             large-k cells, fast then exact mode                                             -> $OUT/seeds.log
#   state     scripts/lab/state_effects.py: what earlier searches of the process change in a later one's time
#             (a small search fresh, after a large one, with workspaces cleared, pools freed)  -> $OUT/state.log
#   fastx     kernel_profile.py on the exclusion cells (FASTX_CELLS, default S1-x200 x20), each cell in three fresh
#             processes: exact mode alone, fast mode alone, exact then fast (gpu-quick 03:59: fast 1.14x / 1.06x
#             exact there, 1.04x / 1.02x at 02:40)                                                 -> $OUT/fastx.log
#   timeline  scripts/lab/timeline.py: where the route and the float32 search leave the GPU idle, with the host's
#             function at each gap (TIMELINE_CELLS, default uh-20k-k100,uh-l2-k2048)            -> $OUT/timeline.log
#   trees     for each folder of .trees/ (carried; a branch exported there: `git archive BRANCH recall tests
#             scripts | tar -x -C .trees/BRANCH`), its GPU tests (TREE_TESTS) and its kernel profile (PROBE_CELLS,
#             PROBE_PRECISION), then this tree's profile of the same cells              -> $OUT/trees.log
#
# Knobs: STEPS (default "setup tests compare"), TEST_TIMEOUT, COMPARE_TIMEOUT, EARLY_TIMEOUT, QUICK_TIMEOUT,
# FILTERS_TIMEOUT, STATE_TIMEOUT, TREE_TIMEOUT, WCHECK_TIMEOUT, NCU_TIMEOUT (seconds), TREE_TESTS (trees: test paths), PROBE_CELLS, PROBE_VARIANTS, PROBE_PRECISION, PROBE_ARGS (probe: more of kernel_profile.py's arguments, e.g. --no-per-kernel), PROBE_TREES (probe; "old new" runs .oldtree/ first), WCHECK_ARGS (wcheck: e.g. --per-cta 8,16), WCHECK_DEFINES (wcheck: builds, a run each), LATENCY_ARGS (latency), QUICK_MINUTES, EARLY_LAYOUTS (default "pyarrow warehouse"), EARLY_BATCH_SIZES (early: e.g. "auto,131072"), TIMELINE_TIMEOUT, TIMELINE_CELLS, TEST_ARGS (extra pytest arguments, e.g. -x), TEST_FIRST (tests: paths run first, then the
# rest without them, each under TEST_TIMEOUT: what a short device lease should check first), ROUNDS (compare: rounds of old, new; 2), COMPARE_ARGS
# (compare: the bench's workload arguments, e.g. "--matrix gpu-quick --cells 0,2,7").
set -u -o pipefail
: "${OUT:?set OUT to the output folder}"
STEPS=${STEPS:-"setup tests compare"}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

has() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has setup; then
    if [ -f .device/faiss-gpu-setup.sh ]; then
        bash .device/faiss-gpu-setup.sh >"$OUT/setup.log" 2>&1 && source /tmp/faiss_env.sh \
            || echo "FAISS setup failed: $(tail -n 3 "$OUT/setup.log")"
    fi
    if [ -f .device-cuvs/cuvs-setup.sh ]; then
        bash .device-cuvs/cuvs-setup.sh >>"$OUT/setup.log" 2>&1 && source /tmp/cuvs_env.sh \
            || echo "cuVS setup failed: $(tail -n 3 "$OUT/setup.log")"
    fi
fi
NEW_PATH=".${PYTHONPATH:+:$PYTHONPATH}"
OLD_PATH=".oldtree${PYTHONPATH:+:$PYTHONPATH}"

if has tests; then
    ignore=""
    if [ -n "${TEST_FIRST:-}" ]; then
        # shellcheck disable=SC2086
        PYTHONPATH=$NEW_PATH timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider \
            ${TEST_ARGS:-} $TEST_FIRST >"$OUT/gpu-tests-first.log" 2>&1
        echo "== gpu tests first: $TEST_FIRST (rc $?, ${SECONDS} s): $(tail -n 1 "$OUT/gpu-tests-first.log")"
        grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests-first.log" | head -n 20
        ignore="tests"
        for path in $TEST_FIRST; do ignore="$ignore --ignore=$path"; done
    fi
    # shellcheck disable=SC2086
    PYTHONPATH=$NEW_PATH timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider \
        ${TEST_ARGS:-} $ignore >"$OUT/gpu-tests.log" 2>&1
    echo "== gpu tests (rc $?, ${SECONDS} s): $(tail -n 1 "$OUT/gpu-tests.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 20
fi

if has sweep; then
    PYTHONPATH=$NEW_PATH:tests timeout 300 python3 scripts/lab/soundness_sweep.py --device gpu \
        --minutes "${SWEEP_MINUTES:-2}" --json "$OUT/sweep.json" >"$OUT/sweep.log" 2>&1
    echo "== sweep, small cells (rc $?)"; tail -n 14 "$OUT/sweep.log"
    PYTHONPATH=$NEW_PATH:tests timeout 300 python3 scripts/lab/soundness_sweep.py --device gpu --large \
        --minutes "${SWEEP_LARGE_MINUTES:-2}" --json "$OUT/sweep-large.json" >"$OUT/sweep-large.log" 2>&1
    echo "== sweep, GPU-sized cells (rc $?)"; tail -n 14 "$OUT/sweep-large.log"
fi

if has compare; then
    (
        for round in $(seq 1 "${ROUNDS:-2}"); do
            for tree in old new; do
                path=$NEW_PATH; [ "$tree" = old ] && path=$OLD_PATH
                echo "### round $round, $tree tree"
                # -P: `python -m` would put the working directory (this tree) ahead of PYTHONPATH, and the "old"
                # runs would import the new tree's recall.
                PYTHONPATH=$path python3 -P -c 'import recall; print("recall from", recall.__file__)'
                # shellcheck disable=SC2086
                PYTHONPATH=$path python3 -P -m recall bench --device gpu --contenders recall \
                    ${COMPARE_ARGS:---repeat 3 -w S1 -w S2 -w S3 -w S4 --sample-users 1000} \
                    --out "/tmp/compare-$tree-$round" >"/tmp/compare-$tree-$round.log" 2>&1
                echo "rc $?"
                grep -E "^\| [S0-9]" "/tmp/compare-$tree-$round/results.md" || tail -n 5 "/tmp/compare-$tree-$round.log"
                grep -E "^(problem|error)" "/tmp/compare-$tree-$round.log"
            done
        done
    ) >"$OUT/compare.log" 2>&1 &
    pid=$!
    ( sleep "${COMPARE_TIMEOUT:-330}"; kill -- -$pid 2>/dev/null; pkill -f "recall bench" ) &
    wait $pid
    echo "== compare (old vs new, recall only)"; cat "$OUT/compare.log"
fi

if has early; then
    PYTHONPATH=$NEW_PATH timeout "${EARLY_TIMEOUT:-240}" python3 scripts/lab/e2e_layouts.py --users 1000000 \
        --items 1000000 --dim 64 --k 100 $(for l in ${EARLY_LAYOUTS:-pyarrow warehouse}; do printf -- '--layout %s ' "$l"; done) --repeat 2 \
        --batch-size "${EARLY_BATCH_SIZES:-auto}" --json "$OUT/early.json" >"$OUT/early.log" 2>&1
    echo "== early searches on / off (rc $?)"; tail -n 8 "$OUT/early.log"
fi

if has quick; then
    # cuVS alone first, plain and with a per-user bitmap, each in its own process: a native crash there must not
    # take the matrix with it.
    families=recall,faiss,cuvs,torch
    for w in S1 S1-x200; do
        PYTHONPATH=$NEW_PATH timeout 90 python3 -m recall bench --device gpu -w "$w" --contenders cuvs --repeat 1 \
            --sample-users 200 --out "/tmp/cuvs-$w" >"/tmp/cuvs-$w.log" 2>&1
        rc=$?; echo "== cuVS alone on $w (rc $rc): $(grep -E "cuvs: " "/tmp/cuvs-$w.log" | head -n 1)"
        if [ "$w" = S1 ] && [ $rc -ne 0 ]; then families=recall,faiss,torch; tail -n 5 "/tmp/cuvs-$w.log"; fi
    done
    PYTHONPATH=$NEW_PATH timeout "${QUICK_TIMEOUT:-560}" python3 -m recall bench --device gpu --matrix gpu-quick \
        --contenders "$families" --max-minutes "${QUICK_MINUTES:-8.5}" --out "$OUT/quick" >"$OUT/quick.log" 2>&1
    echo "== matrix gpu-quick (rc $?)"; cat "$OUT/quick/results.md" 2>/dev/null | head -n 60 || tail -n 30 "$OUT/quick.log"
fi

if has filters; then
    PYTHONPATH=$NEW_PATH timeout "${FILTERS_TIMEOUT:-300}" python3 -m recall bench --device gpu \
        -w S1-x200 -w S1-allow10 --contenders recall,faiss,cuvs,torch --repeat 3 --out "$OUT/filters" \
        >"$OUT/filters.log" 2>&1
    echo "== filters (rc $?)"; grep -E "^\|" "$OUT/filters/results.md" 2>/dev/null | head -n 30 || tail -n 30 "$OUT/filters.log"
    # The job-sized case: 1M users with 20 exclusions each against the same search without them, resident and
    # Parquet to Parquet (--e2e: the exclusions file read and mapped while the items load).
    PYTHONPATH=$NEW_PATH timeout "${FILTERS_TIMEOUT:-300}" python3 -m recall bench --device gpu \
        -w S4 -w S4-x20 --contenders recall --repeat 2 --sample-users 1000 --e2e --out "$OUT/filters-s4" \
        >>"$OUT/filters.log" 2>&1
    echo "== S4 with and without exclusions (rc $?)"; grep -E "^\|" "$OUT/filters-s4/results.md" 2>/dev/null \
        || tail -n 20 "$OUT/filters.log"
fi

if has fastcells; then
    PYTHONPATH=$NEW_PATH timeout "${FAST_TIMEOUT:-120}" python3 -m recall bench --device gpu --matrix gpu-quick \
        --cells "${FAST_CELLS:-0,6,8,10,12,13,15,18,19,23}" --contenders recall --out "$OUT/fast" >"$OUT/fast.log" 2>&1
    echo "== fast-mode cells (rc $?)"; grep -E "^\| [0-9]" "$OUT/fast/results.md" 2>/dev/null || tail -n 20 "$OUT/fast.log"
fi

if has fastgrid; then
    # The gpu-fast grid (issue 18's cells, S1-S4 on skewed norms) with its anchors.
    PYTHONPATH=$NEW_PATH timeout "${FASTGRID_TIMEOUT:-420}" python3 -m recall bench --device gpu --matrix gpu-fast \
        ${FASTGRID_CELLS:+--cells "$FASTGRID_CELLS"} --contenders "${FASTGRID_CONTENDERS:-recall,faiss,cuvs,torch}" \
        --max-minutes "${FASTGRID_MINUTES:-6.0}" --out "$OUT/fastgrid" >"$OUT/fastgrid.log" 2>&1
    echo "== matrix gpu-fast (rc $?)"; cat "$OUT/fastgrid/results.md" 2>/dev/null | head -n 40 || tail -n 30 "$OUT/fastgrid.log"
fi

if has jobx; then
    PYTHONPATH=$NEW_PATH timeout "${JOBX_TIMEOUT:-90}" python3 -m recall bench --device gpu -w S4-x20 \
        --contenders recall --repeat 1 --sample-users 1000 --e2e --out "$OUT/jobx" >"$OUT/jobx.log" 2>&1
    echo "== S4-x20 job (rc $?)"; grep -E "^\| S4" "$OUT/jobx/results.md" 2>/dev/null || tail -n 20 "$OUT/jobx.log"
fi

if has shards; then
    PYTHONPATH=$NEW_PATH timeout "${SHARDS_TIMEOUT:-60}" python3 scripts/lab/item_shards_gpu.py >"$OUT/shards.log" 2>&1
    echo "== item shards on one GPU (rc $?)"; tail -n 12 "$OUT/shards.log"
fi

if has probe; then
    for tree in ${PROBE_TREES:-new}; do
        path=$NEW_PATH; [ "$tree" = old ] && path=$OLD_PATH
        echo "### $tree tree"
        PYTHONPATH=$path timeout "${PROBE_TIMEOUT:-300}" python3 scripts/lab/kernel_profile.py \
            ${PROBE_CELLS:+--cells "$PROBE_CELLS"} ${PROBE_VARIANTS:+--variants "$PROBE_VARIANTS"} \
            ${PROBE_PRECISION:+--precision "$PROBE_PRECISION"} ${PROBE_ARGS:-} \
            --json "$OUT/probe-$tree.json" 2>&1
        echo "rc $?"
    done >"$OUT/probe.log"
    echo "== kernel profile"; grep -v "launches timed" "$OUT/probe.log" | tail -n 80
fi

if has latency; then
    # shellcheck disable=SC2086
    PYTHONPATH=$NEW_PATH timeout "${LATENCY_TIMEOUT:-180}" python3 scripts/lab/embedded_latency.py ${LATENCY_ARGS:-} \
        --json "$OUT/latency.json" >"$OUT/latency.log" 2>&1
    echo "== embedded latency (rc $?)"; tail -n 30 "$OUT/latency.log"
fi

if has micro; then
    for w in ${MICRO_WIDTHS:-72 136 264}; do
        echo "### width $w"
        PYTHONPATH=$NEW_PATH timeout "${MICRO_TIMEOUT:-120}" python3 scripts/lab/fused_h_micro.py --width "$w" \
            --json "$OUT/micro-$w.json" 2>&1
    done >"$OUT/micro.log"
    echo "== fused kernel alone"; cat "$OUT/micro.log"
fi

if has wcheck; then
    # One run a build of WCHECK_DEFINES (space-separated, e.g. "-DRW_SBO_PAD=16 -DRW_A_REGS=1"), each
    # checked and timed against the shipped kernel; without it, one run of WCHECK_ARGS.
    n=0
    for defines in ${WCHECK_DEFINES:-shipped}; do
        n=$((n + 1))
        [ "$defines" = shipped ] && defines=""
        # shellcheck disable=SC2086
        PYTHONPATH=$NEW_PATH timeout "${WCHECK_TIMEOUT:-150}" python3 scripts/lab/fused_w_check.py ${WCHECK_ARGS:-} \
            ${defines:+--defines=$defines} --json "$OUT/fused_w$n.json" >"$OUT/fused_w$n.log" 2>&1
        echo "== wgmma kernel ${defines:-as shipped} (rc $?)"; grep -v "users wrong 0 of" "$OUT/fused_w$n.log" | tail -n 30
    done
fi

if has ncu; then
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    # NCU_SHAPES: "WIDTH ITEMS RANK" triples separated by ";" (the route's pass at k = 1,000 on 200k x 100k x 64:
    # "80 100000 760", about its 1.2% of survivors a launch; "80 100000 8": the loop with few); NCU_KERNELS: mma wgmma
    IFS=';' read -r -a NCU_SHAPE_LIST <<<"${NCU_SHAPES:-72 262144 126;48 100000 1900}"
    for shape in "${NCU_SHAPE_LIST[@]}"; do
        for kernel in ${NCU_KERNELS:-mma wgmma}; do
            # shellcheck disable=SC2086
            set -- $shape
            flag=$([ "$kernel" = wgmma ] && echo --wgmma || true)
            PYTHONPATH=$NEW_PATH timeout "${NCU_TIMEOUT:-150}" "$NCU" --clock-control none -k regex:recall_fused_filter_ \
                -s 2 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
                --section SchedulerStats --section Occupancy --section InstructionStats \
                python3 scripts/lab/fused_ncu.py "$1" "$2" "$3" $flag >"$OUT/ncu-$kernel-$1-$3.log" 2>&1
            echo "== ncu $kernel $shape (rc $?)"
            grep -E "Duration|Issue Slots Busy|Eligible Warps|Stall|Executed Ipc Active|Registers Per" \
                "$OUT/ncu-$kernel-$1-$3.log" | head -n 12
        done
    done
fi

if has seeds; then
    (
        PYTHONPATH=$NEW_PATH timeout "${SEEDS_TIMEOUT:-200}" python3 scripts/lab/kernel_profile.py --precision fast \
            --cells uh-k100,k2048-l2,k1000-cos --variants shipped,seed2k,seed4k,seed16k,seed32k,seed64k \
            --json "$OUT/seeds-fast.json"
        PYTHONPATH=$NEW_PATH timeout 80 python3 scripts/lab/kernel_profile.py --cells uh-k100 \
            --variants shipped,seed2k,seed4k,seed16k --json "$OUT/seeds-exact.json"
    ) >"$OUT/seeds.log" 2>&1
    echo "== threshold sample sizes"; grep -v "launches timed" "$OUT/seeds.log" | tail -n 40
fi

if has state; then
    PYTHONPATH=$NEW_PATH timeout "${STATE_TIMEOUT:-150}" python3 scripts/lab/state_effects.py \
        --json "$OUT/state.json" >"$OUT/state.log" 2>&1
    echo "== state effects (rc $?)"; cat "$OUT/state.log"
fi

if has fastx; then
    (
        for cell in ${FASTX_CELLS:-S1-x200 x20}; do
            for how in "exact" "fast --no-exact-first" "fast"; do
                echo "### $cell: --precision $how"
                # shellcheck disable=SC2086
                PYTHONPATH=$NEW_PATH timeout 120 python3 scripts/lab/kernel_profile.py --no-per-kernel --cells "$cell" \
                    --variants shipped --precision $how 2>&1 | grep -v "launches timed"
            done
        done
    ) >"$OUT/fastx.log" 2>&1
    echo "== fast against exact on the exclusion cells"; cat "$OUT/fastx.log"
fi

if has timeline; then
    PYTHONPATH=$NEW_PATH timeout "${TIMELINE_TIMEOUT:-200}" python3 scripts/lab/timeline.py \
        --cells "${TIMELINE_CELLS:-uh-20k-k100,uh-l2-k2048}" --variants shipped,float32 --host --gaps 10 \
        --json "$OUT/timeline.json" >"$OUT/timeline.log" 2>&1
    echo "== timeline (rc $?)"; grep -v Warning "$OUT/timeline.log"
fi

if has trees; then
    (
        for tree in .trees/*/ .; do
            [ -d "$tree/recall" ] || continue
            echo "### tree $tree"
            if [ "$tree" != . ]; then
                # shellcheck disable=SC2086
                (cd "$tree" && PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout "${TREE_TIMEOUT:-200}" python3 -m pytest \
                    -m gpu -q -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning ${TREE_TESTS:-tests} 2>&1 | tail -n 15)
            fi
            PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout "${TREE_TIMEOUT:-200}" python3 "$tree/scripts/lab/kernel_profile.py" \
                ${PROBE_CELLS:+--cells "$PROBE_CELLS"} --variants shipped ${PROBE_PRECISION:+--precision "$PROBE_PRECISION"} 2>&1 \
                | grep -v "launches timed"
        done
    ) >"$OUT/trees.log" 2>&1
    echo "== trees"; cat "$OUT/trees.log"
fi
