#!/usr/bin/env bash
# Model-checks the lock-free holders with loom: the ready slots (actors/src/holders/ready.rs)
# and the budget (actors/src/books/budget.rs), built with `--cfg pinpool_loom` in a target
# directory of their own. LOOM_MAX_PREEMPTIONS bounds the interleavings explored (default 3).
# See docs/reliability.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUSTFLAGS="--cfg pinpool_loom"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/loom}"
start=$(date +%s)
cargo test -p pinpool-actors --release --lib loom_models -- --test-threads=1
echo "== loom models, LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS: $(( $(date +%s) - start )) s"
