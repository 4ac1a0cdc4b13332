#!/usr/bin/env bash
# The measurements behind BENCHMARKS.md, built on a machine with Rust and run on a GPU machine
# without it.
#
#   scripts/gpu-bench.sh build [DIR]        build gpu_bench, device_bench and serve (release,
#                                           feature cuda) and copy them, the scripts they need,
#                                           the repository's traces and (when ../shared is
#                                           there) the anchors and their traces into DIR
#                                           (default .dev/bench)
#   scripts/gpu-bench.sh run DIR RUN_DIR    on the GPU machine: the host and device side by
#                                           sides (the repository's traces replayed too) and
#                                           serve with and without caps; the figures go to
#                                           RUN_DIR as host.txt, device.txt, serve.txt and
#                                           machine.txt, ready for scripts/bench-tables.py
#
# DIR also gets device-ab.sh and ab-medians.py, for interleaved quick runs of variants (a
# binary, environment settings) and their medians.
#
# DIR/base/, when present, holds the same three programs built from an earlier commit: they
# run right after the current ones, and their figures are printed as `base <metric> ...`, so a
# change is compared with its baseline on one machine in one run.
set -euo pipefail
mode="${1:-}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

build() {
    local root dir target
    root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/.." && pwd))"
    dir="${1:-$root/.dev/bench}"
    target="${CARGO_TARGET_DIR:-$root/target}"
    mkdir -p "$dir/traces"
    (cd "$root" && cargo build --release --features cuda \
        --example gpu_bench --example device_bench --example serve)
    for p in gpu_bench device_bench serve; do
        cp -f "$target/release/examples/$p" "$dir/$p"
        strip --strip-debug "$dir/$p" 2>/dev/null || true
    done
    cp -f "$here/gpu-bench.sh" "$here/serve-compare.sh" "$here/device-ab.sh" \
        "$here/ab-medians.py" "$dir/"
    cp -f "$root"/traces/*.trace.gz "$dir/traces/"
    if [ -d "$root/../shared/anchors" ]; then
        mkdir -p "$dir/shared"
        cp -rf "$root/../shared/anchors" "$root/../shared/traces" "$dir/shared/"
        rm -rf "$dir/shared/traces/minimalloc"
    fi
    du -sh "$dir" >&2
}

run() {
    local dir="${1:?DIR}" out="${2:?RUN_DIR}" anchors tmp
    mkdir -p "$out"
    dir="$(cd "$dir" && pwd)"
    out="$(cd "$out" && pwd)"
    anchors="$dir/shared/anchors"
    tmp="$(mktemp -d)"
    {
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
        [ -f "$dir/commit.txt" ] && cat "$dir/commit.txt"
        date -u +%Y-%m-%d
    } >"$out/machine.txt"
    local traces=("$dir"/traces/*.trace.gz)
    echo "=== host side by side" >&2
    OUT="$tmp" "$anchors/side_by_side.sh" "$dir/gpu_bench" --policy default >&2 || true
    cat "$tmp"/side_by_side/{torch,mempool,pinpool}.txt >"$out/host.txt" 2>/dev/null || true
    if [ -x "$dir/base/gpu_bench" ]; then
        "$dir/base/gpu_bench" --policy default | sed -n 's/^pinpool /base /p' >>"$out/host.txt" || true
    fi
    echo "=== device side by side" >&2
    OUT="$tmp" EXTRA_TRACES="${traces[*]}" "$anchors/side_by_side_device.sh" "$dir/device_bench" >&2 || true
    cat "$tmp"/side_by_side_device/{torch,pinpool}.txt >"$out/device.txt" 2>/dev/null || true
    if [ -x "$dir/base/device_bench" ]; then
        "$dir/base/device_bench" "$tmp"/side_by_side_device/traces/*.txt |
            sed -n 's/^pinpool /base /p' >>"$out/device.txt" || true
    fi
    echo "=== serve, capped and not" >&2
    "$dir/serve-compare.sh" "$dir/serve" 3 >"$out/serve.txt" || true
    if [ -x "$dir/base/serve" ]; then
        "$dir/serve-compare.sh" "$dir/base/serve" 3 | sed -n 's/^pinpool /base /p' >>"$out/serve.txt" || true
    fi
    rm -rf "$tmp"
    ls -la "$out" >&2
}

case "$mode" in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    *) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
