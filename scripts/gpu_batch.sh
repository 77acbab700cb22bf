#!/usr/bin/env bash
# `recall batch --gpus all` on every GPU of one host (issue 6), from the repo root with $OUT set: the same nightly-style
# job (scripts/make_batch_data.py) run with --gpus 1 and with --gpus all. Records both wall clocks and the speed-up,
# samples nvidia-smi during both runs (every GPU busy?), and checks every output shard of the all-GPU run is
# byte-identical (cmp) to the one-GPU run's and that the two manifests agree.
#
#   OUT=/some/folder bash scripts/gpu_batch.sh    # USERS= ITEMS= DIM= K= SHARDS= EXCL= SEED= RUN_TIMEOUT= DEVICE=
#
# Fair timings: a small warm-up job (same dim, k and exclusions, every GPU) runs first, so that CuPy's and Numba's
# on-disk caches hold the compiled kernels and neither timed run pays for compiling them. What each timed run still
# pays, inside its wall clock, because every real run pays it too: Python start-up, and per worker process a CUDA
# context, reading and uploading the items (items_load_s), plus the parent's fingerprint of the inputs. The JSON also
# gives scoring_s (the busiest worker's summed shard times), the part that should scale with the number of GPUs.
# Under $OUT: batch_x2.json (the summary), batch_x2.log (every step's output), batch_x2_smi.csv (phase, timestamp,
# gpu, util %, MiB), batch_x2_metrics.json (both runs' _metrics.json and _manifest.json). Every step has a time
# limit (RUN_TIMEOUT per timed run, default 120 s): the script ends within about 8 minutes, exit 0 only when both
# runs succeeded with identical outputs.
set -u -o pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
USERS=${USERS:-400000} ITEMS=${ITEMS:-1000000} DIM=${DIM:-64} K=${K:-100} SHARDS=${SHARDS:-16} EXCL=${EXCL:-5}
SEED=${SEED:-0} RUN_TIMEOUT=${RUN_TIMEOUT:-120}
DEVICE=${DEVICE:-gpu}  # cpu: a dry run of this script's steps where there is no GPU
mkdir -p "$OUT"
# Scratch of this run only (never another user's or run's files), removed at the end; the log goes to $OUT.
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/recall-gpu-batch.XXXXXX") || exit 1
DATA=$SCRATCH/data WARM=$SCRATCH/warm WARM_OUT=$SCRATCH/warm_out LOG=$OUT/batch_x2.log
OUT1=$SCRATCH/out1 OUT2=$SCRATCH/out2 CMP=$SCRATCH/cmp.txt SMI=$SCRATCH/smi.csv
: >"$LOG"

# step NAME LIMIT CMD...: output appended to $LOG; sets RC and SECS (wall clock of the command).
step() {
    local name=$1 limit=$2 t0; shift 2
    echo "== $name: $*" >>"$LOG"
    t0=$(date +%s.%N)
    timeout "$limit" "$@" >>"$LOG" 2>&1
    RC=$?
    SECS=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }')
    echo "== $name: rc $RC, $SECS s" | tee -a "$LOG"
}
# GPU samples every 500 ms into $SCRATCH/smi_PHASE.csv (line-buffered: a TERM loses no sample).
smi_start() {
    local buf=(); command -v stdbuf >/dev/null && buf=(stdbuf -oL)
    "${buf[@]}" nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader,nounits \
        -lms 500 >"$SCRATCH/smi_$1.csv" 2>>"$LOG" &
    SMI_PID=$!
}
smi_stop() { kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; SMI_PID=; }
SMI_PID=
trap '[ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null; rm -rf "$SCRATCH"' EXIT
# recall batch on DATA_DIR's users, items (and exclusions, when there are some), on the GPU.
batch_cmd() {
    local data=$1
    BATCH=(python3 -m recall batch --users "$data/users" --items "$data/items.parquet" --k "$K" --device "$DEVICE" -v)
    if [ -f "$data/exclusions.parquet" ]; then BATCH+=(--exclude "$data/exclusions.parquet"); fi
}

timeout 20 nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader >>"$LOG" 2>&1
N_GPUS=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "GPUs: $N_GPUS; job: $USERS users x $ITEMS items, dim $DIM, k $K, $SHARDS shards, $EXCL exclusions per user"
[ "$N_GPUS" -ge 2 ] || echo "warning: fewer than 2 GPUs, --gpus all cannot be faster than --gpus 1"

step "data" 45 python3 scripts/make_batch_data.py --out "$DATA" --users "$USERS" --items "$ITEMS" --dim "$DIM" \
    --shards "$SHARDS" --exclusions-per-user "$EXCL" --seed "$SEED"
DATA_RC=$RC
step "warm-up data" 30 python3 scripts/make_batch_data.py --out "$WARM" --users 20000 --items 50000 --dim "$DIM" \
    --shards "$(( N_GPUS > 1 ? N_GPUS : 2 ))" --exclusions-per-user "$EXCL" --seed 1
batch_cmd "$WARM"
step "warm-up (all GPUs: fills the kernel caches)" 75 "${BATCH[@]}" --out "$WARM_OUT" --gpus all
WARM_S=$SECS WARM_RC=$RC

# The CPU dry run: a CPU search's tiling follows its worker's number of cores (one user block per core), and the
# last bits of float32 scores follow the tiling, so the one-worker run gets one core, as each of the two workers of
# the other run does; otherwise the byte comparison below fails on every machine with more than one core.
PIN1=() PIN2=()
if [ "$DEVICE" = cpu ]; then
    read -r C0 C1 _ < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)), "")')
    if [ -n "${C1:-}" ] && command -v taskset >/dev/null; then PIN1=(taskset -c "$C0") PIN2=(taskset -c "$C0,$C1"); fi
fi
smi_start 1gpu
batch_cmd "$DATA"
step "1 GPU" "$RUN_TIMEOUT" "${PIN1[@]}" "${BATCH[@]}" --out "$OUT1" --gpus 1
smi_stop
RC1=$RC S1=$SECS
smi_start all
if [ "$DEVICE" = cpu ]; then BATCH+=(--workers 2); fi  # the dry run still spawns worker processes
step "all GPUs" "$RUN_TIMEOUT" "${PIN2[@]}" "${BATCH[@]}" --out "$OUT2" --gpus all
smi_stop
RC2=$RC S2=$SECS

# Every output shard of the one-GPU run against the all-GPU run's, byte for byte.
for f in "$OUT1"/*.parquet "$OUT2"/*.parquet; do
    [ -e "$f" ] || continue
    name=${f##*/}
    if timeout 5 cmp -s "$OUT1/$name" "$OUT2/$name"; then echo "same $name"; else echo "differs $name"; fi
done | sort -u >"$CMP"
grep '^differs' "$CMP" >>"$LOG"

for phase in 1gpu all; do sed "s/^/$phase, /" "$SCRATCH/smi_$phase.csv" 2>/dev/null; done >"$SMI"
cp "$SMI" "$OUT/batch_x2_smi.csv"

USERS=$USERS ITEMS=$ITEMS DIM=$DIM K=$K SHARDS=$SHARDS EXCL=$EXCL N_GPUS=$N_GPUS DATA_RC=$DATA_RC WARM_S=$WARM_S \
WARM_RC=$WARM_RC RC1=$RC1 S1=$S1 RC2=$RC2 S2=$S2 OUT1=$OUT1 OUT2=$OUT2 OUTDIR=$OUT CMP=$CMP SMI=$SMI timeout 30 python3 - <<'PY'
import collections, json, os
from pathlib import Path

e = os.environ
out1, out2, outdir = Path(e["OUT1"]), Path(e["OUT2"]), Path(e["OUTDIR"])


def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run(out, rc, secs):
    metrics, manifest = load(out / "_metrics.json"), load(out / "_manifest.json")
    per_worker = collections.defaultdict(float)
    for shard in metrics.get("shards", {}).values():
        per_worker[shard.get("worker")] += shard.get("seconds", 0.0)
    users = int(e["USERS"])
    return {
        "rc": int(rc), "seconds": float(secs), "success": (out / "_SUCCESS").exists(),
        "users_per_s": round(users / float(secs), 1) if float(secs) > 0 and int(rc) == 0 else None,
        "job_seconds": metrics.get("job", {}).get("seconds"),
        "workers": len(metrics.get("workers", [])),
        "items_load_s": {w["worker"]: w["items_load_s"] for w in metrics.get("workers", [])},
        "cuda_visible_devices": {w["worker"]: w.get("cuda_visible_devices") for w in metrics.get("workers", [])},
        "shards_per_worker": dict(collections.Counter(s.get("worker") for s in metrics.get("shards", {}).values())),
        "scoring_s": round(max(per_worker.values(), default=0.0), 3),
        "shard_seconds_per_worker": {w: round(s, 3) for w, s in per_worker.items()},
    }, metrics, manifest


def utilisation(phase):
    rows = collections.defaultdict(list)  # gpu -> [(util, mem)]
    for line in Path(e["SMI"]).read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5 and parts[0] == phase and parts[3].isdigit():
            rows[parts[2]].append((int(parts[3]), float(parts[4])))
    res = {}
    for gpu, samples in sorted(rows.items()):
        util = [u for u, _ in samples]
        busy = [i for i, u in enumerate(util) if u > 0]
        active = util[busy[0]:busy[-1] + 1] if busy else []
        res[gpu] = {"samples": len(util), "util_max": max(util), "util_mean": round(sum(util) / len(util), 1),
                    "util_mean_while_active": round(sum(active) / len(active), 1) if active else 0.0,
                    "busy_samples": len(busy), "memory_used_max_mib": max(m for _, m in samples)}
    return res


r1, metrics1, manifest1 = run(out1, e["RC1"], e["S1"])
r2, metrics2, manifest2 = run(out2, e["RC2"], e["S2"])
cmp_lines = Path(e["CMP"]).read_text().split("\n") if Path(e["CMP"]).exists() else []
same = [line.split()[1] for line in cmp_lines if line.startswith("same ")]
differ = [line.split()[1] for line in cmp_lines if line.startswith("differs ")]
o1, o2 = manifest1.get("outputs", {}), manifest2.get("outputs", {})
manifest_diffs = sorted(f"{name}.{key}" for name in set(o1) | set(o2)
                        for key in set(o1.get(name, {})) | set(o2.get(name, {}))
                        if o1.get(name, {}).get(key) != o2.get(name, {}).get(key))
shards = int(e["SHARDS"])
identical = (r1["rc"] == 0 and r2["rc"] == 0 and r1["success"] and r2["success"] and not differ
             and len(same) == shards and not manifest_diffs and len(o1) == shards)
summary = {
    "users": int(e["USERS"]), "items": int(e["ITEMS"]), "dim": int(e["DIM"]), "k": int(e["K"]), "shards": shards,
    "exclusions_per_user": int(e["EXCL"]), "gpus_on_host": int(e["N_GPUS"]), "data_rc": int(e["DATA_RC"]),
    "warmup": {"rc": int(e["WARM_RC"]), "seconds": float(e["WARM_S"])},
    "seconds_1gpu": r1["seconds"], "seconds_all": r2["seconds"],
    "speedup": round(r1["seconds"] / r2["seconds"], 3) if r1["rc"] == r2["rc"] == 0 else None,
    "speedup_scoring": round(r1["scoring_s"] / r2["scoring_s"], 3) if identical and r2["scoring_s"] > 0 else None,
    "users_per_s_1gpu": r1["users_per_s"], "users_per_s_all": r2["users_per_s"],
    "run_1gpu": r1, "run_all": r2,
    "utilisation_1gpu": utilisation("1gpu"), "utilisation_all": utilisation("all"),
    "shards_identical": len(same), "shards_differing": differ, "manifest_differences": manifest_diffs[:20],
    "identical": identical,
}
(outdir / "batch_x2.json").write_text(json.dumps(summary, indent=1) + "\n")
(outdir / "batch_x2_metrics.json").write_text(json.dumps(
    {"gpus_1": {"metrics": metrics1, "manifest": manifest1}, "gpus_all": {"metrics": metrics2, "manifest": manifest2}},
    indent=1) + "\n")

print(f"\n{summary['users']:,} users x {summary['items']:,} items, dim {summary['dim']}, k {summary['k']}, "
      f"{shards} shards, {summary['exclusions_per_user']} exclusions per user; warm-up {float(e['WARM_S']):.1f} s")
for label, r in (("--gpus 1  ", r1), ("--gpus all", r2)):
    loads = ", ".join(f"{w} {s:.1f}" for w, s in r["items_load_s"].items())
    print(f"{label}: rc {r['rc']}, {r['seconds']:.1f} s wall ({r['users_per_s'] or 0:,.0f} users/s), "
          f"{r['workers']} worker(s), scoring {r['scoring_s']:.1f} s, items load s: {loads}")
times = lambda x: f"{x}x" if x else "n/a"  # noqa: E731
print(f"speed-up: {times(summary['speedup'])} wall, {times(summary['speedup_scoring'])} scoring "
      f"(scoring: the busiest worker's summed shard times, without start-up and item loading)")
for gpu, u in summary["utilisation_all"].items():
    print(f"--gpus all, GPU {gpu}: util max {u['util_max']}%, mean {u['util_mean']}% "
          f"({u['util_mean_while_active']}% while active), {u['busy_samples']}/{u['samples']} samples busy, "
          f"max {u['memory_used_max_mib']:,.0f} MiB")
print(f"outputs: {len(same)}/{shards} shards byte-identical, {len(differ)} differ, manifest differences: "
      f"{len(manifest_diffs)} -> identical: {str(identical).lower()}")
raise SystemExit(0 if identical else 1)
PY
STATUS=$?
exit "$STATUS"  # 0: both runs succeeded and their outputs are identical
