#!/usr/bin/env bash
# Runs `serve` under its default caps and with the caps lifted, alternately, and prints the
# medians as `<impl> <metric> <number>` lines for scripts/bench-tables.py: impl `pinpool` is
# the capped run, `uncapped` the same server with no caps, so each ratio reads "capped over
# uncapped".
#   usage: scripts/serve-compare.sh SERVE_BINARY [ROUNDS (default 3)] [-- serve arguments...]
set -euo pipefail
serve=${1:?usage: serve-compare.sh SERVE_BINARY [ROUNDS] [-- serve arguments]}
shift
rounds=3
if [ $# -gt 0 ] && [ "$1" != "--" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] && shift
extra=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# One run's figures, from serve's tables: throughput, mean wait for a request's buffers,
# device driver calls (taken + given back) per device allocation, caches emptied.
figures() {
  python3 - "$1" <<'EOF'
import re, sys
rows = {}
for line in open(sys.argv[1]):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) >= 2:
        rows[cells[0]] = cells[1:]
def num(s):
    m = re.search(r"-?[0-9.]+", s.replace(" ", ""))
    return float(m.group()) if m else float("nan")
thr = num(rows["throughput"][0])
wait = next(num(v[0]) for k, v in rows.items() if k.startswith("mean time to get"))
allocated = num(rows["buffers allocated"][1])
taken = num(rows["memory taken from the driver (calls)"][1])
given = num(rows["memory given back to the driver (calls)"][1])
emptied = num(rows["caches emptied to make room"][1])
print(thr, wait, 100.0 * (taken + given) / max(allocated, 1.0), emptied)
EOF
}

for r in $(seq 1 "$rounds"); do
  "$serve" "${extra[@]}" >"$tmp/capped.$r" 2>/dev/null
  figures "$tmp/capped.$r" >>"$tmp/capped"
  "$serve" --max-mib 0 --device-max-mib 0 "${extra[@]}" >"$tmp/uncapped.$r" 2>/dev/null
  figures "$tmp/uncapped.$r" >>"$tmp/uncapped"
done

python3 - "$tmp/capped" "$tmp/uncapped" <<'EOF'
import statistics, sys
names = ["serve_requests_per_s", "serve_buffer_wait_us", "serve_device_driver_calls_per_100_allocs",
         "serve_device_caches_emptied"]
for impl, path in (("pinpool", sys.argv[1]), ("uncapped", sys.argv[2])):
    runs = [list(map(float, l.split())) for l in open(path) if l.strip()]
    for i, name in enumerate(names):
        print(f"{impl} {name} {statistics.median(r[i] for r in runs):.3f}")
EOF
