#!/usr/bin/env bash
# GPU tests of pinpool, built on a machine with Rust and run on a GPU machine without it.
#
#   scripts/gpu-tests.sh build [DIR]   build the `cuda` test binaries and the serve and ipc_peer
#                                      examples in release mode and copy them, with this
#                                      script, into DIR (default: .dev/gpu in the repository root)
#   scripts/gpu-tests.sh run [DIR]     on the GPU machine: run every binary in DIR one test at a
#                                      time, print the output, and write it to DIR/logs (or to
#                                      $LOG_DIR when set); exits non-zero if any failed
#
# Only a CUDA driver (libcuda.so) is needed where the binaries run: cudarc loads it at run
# time. Without one every GPU test prints "skipped: no CUDA driver/GPU" and passes.
# See docs/gpu-tests.md.
set -euo pipefail

mode="${1:-}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

build() {
    local root dir
    root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/.." && pwd))"
    dir="${1:-$root/.dev/gpu}"
    target="${CARGO_TARGET_DIR:-$root/target}"
    mkdir -p "$dir"
    cd "$root"
    echo "building the cuda test binaries (release) ..." >&2
    # Each JSON line for a compiled test target names its executable; keep those of the
    # library's unit tests (which hold the CudaRuntime tests) and of tests/gpu*.rs.
    cargo test --release --features cuda --no-run --message-format=json 2>/dev/null |
        grep '"reason":"compiler-artifact"' | grep '"test":true' |
        while IFS= read -r line; do
            exe="$(printf '%s\n' "$line" | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')"
            name="$(printf '%s\n' "$line" | sed -n 's/.*"target":{[^}]*"name":"\([^"]*\)".*/\1/p')"
            kind="$(printf '%s\n' "$line" | sed -n 's/.*"target":{"kind":\["\([^"]*\)".*/\1/p')"
            [ -n "$exe" ] || continue
            case "$kind:$name" in
                lib:pinpool) cp -f "$exe" "$dir/pinpool_lib" ;;
                test:gpu*) cp -f "$exe" "$dir/$name" ;;
                *) continue ;;
            esac
            echo "  $kind:$name -> $dir" >&2
        done
    echo "building the serve example (release, feature cuda) ..." >&2
    cargo build --release --features cuda --example serve 2>/dev/null
    cp -f "$target/release/examples/serve" "$dir/serve"
    echo "building the ipc_peer example (the other process of the IPC tests) ..." >&2
    cargo build --release --features cuda --example ipc_peer 2>/dev/null
    cp -f "$target/release/examples/ipc_peer" "$dir/ipc_peer"
    cp -f "$here/gpu-tests.sh" "$dir/gpu-tests.sh"
    # The binaries carry line tables (profile.release debug = 1); drop them to travel light.
    if command -v strip >/dev/null; then
        for f in "$dir"/pinpool_lib "$dir"/gpu* "$dir"/serve "$dir"/ipc_peer; do
            [ "$f" = "$dir/gpu-tests.sh" ] || strip --strip-debug "$f" 2>/dev/null || true
        done
    fi
    ls -la "$dir" >&2
}

run() {
    local dir logs status=0
    dir="${1:-$here}"
    logs="${LOG_DIR:-$dir/logs}"
    mkdir -p "$logs"
    echo "pinpool GPU tests, $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    fi
    step() { # name, command...
        local name="$1"
        shift
        echo "=== $name: $*"
        if "$@" 2>&1 | tee "$logs/$name.log"; then
            echo "=== $name: ok"
        else
            echo "=== $name: FAILED"
            status=1
        fi
    }
    set +e
    set -o pipefail
    [ -x "$dir/gpu" ] && step gpu "$dir/gpu" --test-threads=1 --nocapture
    [ -x "$dir/gpu_device" ] && step gpu_device "$dir/gpu_device" --test-threads=1 --nocapture
    [ -x "$dir/gpu_config" ] && step gpu_config "$dir/gpu_config" --test-threads=1 --nocapture
    [ -x "$dir/gpu_ipc_peer" ] && PINPOOL_IPC_PEER="$dir/ipc_peer" \
        step gpu_ipc_peer "$dir/gpu_ipc_peer" --test-threads=1 --nocapture
    [ -x "$dir/pinpool_lib" ] && step cuda_runtime "$dir/pinpool_lib" cuda:: --test-threads=1 --nocapture
    [ -x "$dir/serve" ] && step serve "$dir/serve"
    echo "=== measurements"
    grep -h '^gpu \|^cuda \|^| ' "$logs"/*.log || true
    return $status
}

case "$mode" in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    *)
        sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
