#!/usr/bin/env bash
# Runs the test suite under valgrind memcheck: zero errors expected.
#   scripts/valgrind.sh [TEST-NAME-FILTER]
# Needs valgrind (Debian: apt-get install valgrind). Builds the test binaries (debug), then runs
# every library, integration and unit test binary under memcheck, one test thread at a time.
# Memory still reachable at exit (tokio's and the test harness's globals, thread-locals) is
# not an error; definite leaks and invalid accesses are.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)"; exit 2; }
filter=${1:-}
mapfile -t bins < <(cargo test --workspace --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])')
status=0
for bin in "${bins[@]}"; do
  name=$(basename "$bin")
  echo "== $name"
  # The stress test's short version is long under valgrind; run it too, but alone.
  if ! valgrind --quiet --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
      --show-leak-kinds=definite --fair-sched=yes "$bin" --test-threads=1 $filter 2>&1 | tail -n 20; then
    status=1
  fi
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
[ $status = 0 ] && echo "valgrind: no errors" || echo "valgrind: errors found"
exit $status
