#!/usr/bin/env bash
# Runs the tests of pinpool's unsafe code that miri can run, under miri (undefined
# behaviour, Stacked Borrows, and data races between threads):
#   scripts/miri.sh          everything below
#   scripts/miri.sh --quick  a bounded subset, for CI (a few minutes with a warm build)
# Needs the nightly toolchain with miri (rustup +nightly component add miri). What is run
# and what miri cannot reach: docs/reliability.md.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  echo "miri is not installed (rustup +nightly component add miri)"
  exit 2
fi
quick=false
[ "${1:-}" = "--quick" ] && quick=true
# Threads (tokio's blocking pool, the simulated streams' workers) may outlive a test, and
# their globals stay reachable: not leaks of pinpool's memory, which the tests count. The
# simulated runtime keeps addresses as integers (as CUDA does) and turns them back into
# pointers: permissive provenance.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-ignore-leaks -Zmiri-permissive-provenance}"
miri() {
  local start=$SECONDS
  echo "== cargo +nightly miri test $*"
  cargo +nightly miri test -q "$@"
  echo "== $((SECONDS - start)) s"
}

# The engine's paths end to end: ready slots across threads, parked blocks, typed views,
# carved pieces, plan arena views (tests/robustness/unsafe_paths.rs).
miri -p pinpool --test robustness -- unsafe_paths::
# The simulated runtime's host ranges.
miri -p pinpool --lib -- sim::memory:: sim::tests::
if $quick; then
  exit 0
fi
# The rest: the raw-pointer table (lock-free slots raced by four threads), the simulated
# runtime's streams, events, graphs and faults, and configuration; then the engine's unit
# tests (carving offsets, size classes, shards, the miss path).
miri -p pinpool --lib -- --skip sim::memory:: --skip sim::tests::
miri -p pinpool-actors --lib
