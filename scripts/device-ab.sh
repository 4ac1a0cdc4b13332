#!/usr/bin/env bash
# Interleaved quick runs of device_bench variants on one machine, for before/after
# comparisons of one change (medians with scripts/ab-medians.py).
#
#   scripts/device-ab.sh OUT ROUNDS VARIANT... [-- DEVICE_BENCH_ARGS...]
#
# A VARIANT is NAME=BINARY, optionally followed by :ENV=VALUE,ENV=VALUE (for instance
# `head=.dev/bench/device_bench` and `tc32=.dev/bench/device_bench:PINPOOL_DEVICE_CONF=thread_cache_mb:32`).
# Each round runs every variant once, in order, with `--quick` and the arguments after `--`
# (default: `--runtime auto` and the traces under traces/ and ../shared/traces/ that exist).
# Each output line `pinpool METRIC KEYS VALUE` is appended to OUT as `NAME ROUND METRIC KEYS
# VALUE`.
set -euo pipefail
out=${1:?usage: device-ab.sh OUT ROUNDS VARIANT... [-- ARGS...]}
rounds=${2:?usage: device-ab.sh OUT ROUNDS VARIANT... [-- ARGS...]}
shift 2
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    variants+=("$1")
    shift
done
[ "${1:-}" = "--" ] && shift
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    args=(--runtime auto)
    for t in "$here"/traces/*.trace.gz "$here"/traces/open/*.gz "$here"/../shared/traces/*.trace.gz; do
        [ -f "$t" ] && args+=("$t")
    done
fi
[ ${#variants[@]} -gt 0 ] || { echo "device-ab.sh: no variant given" >&2; exit 2; }
for round in $(seq "$rounds"); do
    for v in "${variants[@]}"; do
        name=${v%%=*}
        rest=${v#*=}
        binary=${rest%%:*}
        envs=""
        [ "$rest" != "$binary" ] && envs=${rest#*:}
        (
            if [ -n "$envs" ]; then
                IFS=, read -r -a pairs <<<"$envs"
                for p in "${pairs[@]}"; do export "${p?}"; done
            fi
            "$binary" --quick "${args[@]}" 2>/dev/null
        ) | sed -n "s/^pinpool /$name $round /p" >>"$out"
    done
done
