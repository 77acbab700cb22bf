#!/usr/bin/env bash
# Nightly recall: every user shard of the day against the day's items, k candidates per user, into a dated directory.
#
#   RUN_DATE=2026-11-30 scripts/nightly_recall.sh          # e.g. from cron: 15 1 * * * /opt/recall/scripts/nightly_recall.sh
#
# Resumable: if the job dies (kill -9, node reboot, GPU fault), run this script again with the same RUN_DATE. Shards
# already written and verified against OUT/_manifest.json are kept; the others are scored again; the outputs are the
# same bytes as an uninterrupted run. OUT/_SUCCESS appears only when every shard is done: downstream jobs wait for it.
# Exit status: 0 done; 2 bad input or OUT holds another job, or a bad setting of this script (an argument given, a
# RUN_DATE that is not a date, an unwritable LOG_DIR, a RECALL command not found): fix it, do not retry; anything
# else: failed, retried RETRIES times here (resuming), then left for the next run of this script.
#
# Every setting is an environment variable with a default below. On a Ray cluster: ENGINE=ray RAY_ADDRESS=auto (or
# ray://head:10001), with USERS, ITEMS and OUT on a file system every node mounts at the same path.
set -euo pipefail

# Settings are environment variables only: a date given as an argument (`nightly_recall.sh 2026-11-30`) would
# otherwise be ignored, and today's job run in its place.
if (($#)); then
    echo "nightly_recall: takes no arguments (got: $*); settings are environment variables, e.g." \
         "RUN_DATE=2026-11-30 $0" >&2
    exit 2
fi
RUN_DATE="${RUN_DATE:-$(date -u +%F)}"
if [[ ! "$RUN_DATE" =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}$ ]] || [[ "$(date -u -d "$RUN_DATE" +%F 2>/dev/null)" != "$RUN_DATE" ]]
then
    echo "nightly_recall: RUN_DATE must be a date YYYY-MM-DD, got '$RUN_DATE'" >&2
    exit 2
fi
USERS="${USERS:-/data/embeddings/users/$RUN_DATE}"            # a directory of *.parquet shards, or a quoted glob
ITEMS="${ITEMS:-/data/embeddings/items/$RUN_DATE/items.parquet}"
EXCLUDE="${EXCLUDE:-}"                                        # optional: user_id, item_id pairs never to return
OUT_ROOT="${OUT_ROOT:-/data/recall}"
OUT="${OUT:-$OUT_ROOT/$RUN_DATE}"
K="${K:-100}"
METRIC="${METRIC:-ip}"
GPUS="${GPUS:-all}"                                           # one worker per GPU of this host
ENGINE="${ENGINE:-local}"                                     # local | ray
RAY_ADDRESS="${RAY_ADDRESS:-}"
LOG_DIR="${LOG_DIR:-/var/log/recall}"
RETRIES="${RETRIES:-1}"
RETRY_DELAY="${RETRY_DELAY:-60}"
RECALL="${RECALL:-recall}"                                    # the command, e.g. "/opt/recall/.venv/bin/recall"
EXTRA_ARGS="${EXTRA_ARGS:-}"                                  # e.g. "--memory-budget 8G --batch-size 32768"

if ! mkdir -p "$LOG_DIR" 2>/dev/null || [[ ! -w "$LOG_DIR" ]]; then
    echo "nightly_recall: LOG_DIR=$LOG_DIR cannot be created or written; set LOG_DIR to a writable directory" >&2
    exit 2
fi
LOG="$LOG_DIR/nightly_recall-$RUN_DATE.log"

read -ra recall_cmd <<<"$RECALL"
# A missing command is a setting to fix, not a failure to retry (it would exit 127 at every attempt).
if ! command -v "${recall_cmd[0]:-}" >/dev/null; then
    echo "nightly_recall: RECALL=$RECALL: command not found; set RECALL to the recall command" \
         "(e.g. /opt/recall/.venv/bin/recall)" | tee -a "$LOG" >&2
    exit 2
fi
read -ra extra <<<"$EXTRA_ARGS"
args=(batch --users "$USERS" --items "$ITEMS" --k "$K" --metric "$METRIC" --out "$OUT" --gpus "$GPUS"
      --engine "$ENGINE")
if [[ -n "$EXCLUDE" ]]; then args+=(--exclude "$EXCLUDE"); fi
if [[ "$ENGINE" == ray && -n "$RAY_ADDRESS" ]]; then args+=(--ray-address "$RAY_ADDRESS"); fi
args+=("${extra[@]}")

log() { echo "$(date -u +%FT%TZ) $*" >>"$LOG"; }

attempt=0
while :; do
    attempt=$((attempt + 1))
    log "start (attempt $attempt): ${recall_cmd[*]} ${args[*]}"
    first_line=$(($(wc -l <"$LOG") + 1))
    status=0
    "${recall_cmd[@]}" "${args[@]}" >>"$LOG" 2>&1 || status=$?
    log "end: exit $status"
    if [[ "$status" -eq 0 ]]; then
        exit 0
    fi
    # This attempt's own output (the error line) on stderr, for cron's mail or the scheduler's log.
    tail -n +"$first_line" "$LOG" | grep -v '^[0-9T:-]*Z \(start\|end\)' >&2 || true
    if [[ "$status" -eq 2 || "$attempt" -gt "$RETRIES" ]]; then
        echo "nightly_recall: failed with exit $status; see $LOG" >&2
        exit "$status"
    fi
    log "retrying in ${RETRY_DELAY}s (the rerun resumes: finished shards are kept)"
    sleep "$RETRY_DELAY"
done
