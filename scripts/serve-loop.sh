#!/usr/bin/env bash
# Runs `serve` under its memory limits many times and counts the runs that hang: a run that
# has not finished within the per-run timeout is a request that waited for ever (the liveness
# rule of docs/reliability.md says none may while the memory it needs is free or cached).
#
#   scripts/serve-loop.sh [RUNS] [-- SERVE-ARGS...]
#
# Environment: SERVE (a serve binary; default: build the release example), JOBS (runs at
# once; default: the number of cores), RUN_TIMEOUT (seconds per run; default 60).
# SERVE-ARGS default to `--requests 2000` (the default caps: 40 MiB pinned, 48 MiB device);
# add e.g. `--policy bestfit` or `--max-mib 8`. Prints one line per failed run and a summary;
# exits 1 if any run hung or failed. The logs of failed runs are kept in a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=1000
if [ $# -gt 0 ] && [ "$1" != "--" ]; then runs=$1; shift; fi
[ "${1:-}" = "--" ] && shift
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--requests 2000)
jobs=${JOBS:-$(nproc)}
per_run=${RUN_TIMEOUT:-60}
if [ -z "${SERVE:-}" ]; then
  cargo build --release --example serve >&2
  SERVE=target/release/examples/serve
fi
logs=$(mktemp -d)
export SERVE per_run logs
echo "serve-loop: $runs runs of $SERVE ${args[*]}, $jobs at a time, ${per_run}s each"
start=$(date +%s)
# Each run prints "ok", "hang" (killed at the timeout) or "fail" (another exit status).
seq 1 "$runs" | xargs -P "$jobs" -I{} bash -c '
  out="$logs/run-{}.log"
  if timeout -k 5 "$per_run" "$SERVE" "$@" >"$out" 2>&1; then
    echo ok; rm -f "$out"
  else
    rc=$?
    if [ $rc = 124 ] || [ $rc = 137 ]; then echo "hang run {}: log $out" >&2; echo hang
    else echo "fail run {} (exit $rc): log $out" >&2; echo fail; fi
  fi' _ "${args[@]}" >"$logs/outcomes"
ok=$(grep -c '^ok$' "$logs/outcomes" || true)
hang=$(grep -c '^hang$' "$logs/outcomes" || true)
fail=$(grep -c '^fail$' "$logs/outcomes" || true)
echo "serve-loop: $runs runs in $(( $(date +%s) - start ))s: $ok ok, $hang hung, $fail failed"
[ "$hang" = 0 ] && [ "$fail" = 0 ] || { echo "serve-loop: logs in $logs"; exit 1; }
rm -rf "$logs"
