#!/usr/bin/env bash
# PyTorch on pinpool, judged on a GPU machine: same results as PyTorch's own allocator, a
# port of PyTorch's allocator tests, and a head-to-head of peak memory and step time against
# PyTorch's three allocator configurations. See docs/torch.md.
#
#   scripts/torch-judge.sh build [DIR]      build libpinpool_torch.so (release, feature cuda)
#                                           and copy it into DIR (default: .dev/torch)
#   scripts/torch-judge.sh run LIB OUT      on the GPU machine (python3 with torch 2.11,
#                                           torchvision, transformers; g++): run everything,
#                                           each configuration in a fresh process, writing
#                                           OUT/judge.log, OUT/summary.json and one log per
#                                           process; finishes in 5 to 8 minutes. LIB
#                                           `installed`: the pinpool_torch package that pip
#                                           installed, with its bundled library, instead of
#                                           the tree's python/ and a built LIB
#
# Every part has its own timeout and the whole run stops after $PINPOOL_JUDGE_TIMEOUT
# seconds (default 570). Exit status: 0 when every verdict passed, 1 otherwise.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mode="${1:-}"

case "$mode" in
build)
    root="$(cd "$here/.." && pwd)"
    dir="${2:-$root/.dev/torch}"
    mkdir -p "$dir"
    (cd "$root" && cargo build --release -p pinpool-torch --features cuda) || exit 1
    target="${CARGO_TARGET_DIR:-$root/target}"
    cp "$target/release/libpinpool_torch.so" "$dir/"
    strip --strip-debug "$dir/libpinpool_torch.so" 2>/dev/null || true
    ls -l "$dir/libpinpool_torch.so"
    ;;
run)
    lib="${2:?usage: scripts/torch-judge.sh run LIB OUT}"
    out="${3:?usage: scripts/torch-judge.sh run LIB OUT}"
    mkdir -p "$out"
    py="${PYTHON:-python3}"
    if [ "$lib" = installed ]; then
        lib="$(cd / && "$py" -c 'import pinpool_torch; print(pinpool_torch.library_path())')" \
            || { echo "torch-judge: no installed pinpool_torch (pip install ./python)"; exit 1; }
    else
        export PYTHONPATH="$here/../python${PYTHONPATH:+:$PYTHONPATH}"
    fi
    export PINPOOL_TORCH_CACHE="${PINPOOL_TORCH_CACHE:-/tmp/pinpool_torch_cache}"
    limit="${PINPOOL_JUDGE_TIMEOUT:-570}"
    timeout -k 10 "$limit" "$py" -u "$here/torch_judge.py" --lib "$lib" --out "$out" \
        --budget "$((limit - 15))"
    status=$?
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "torch-judge: stopped after ${limit}s" | tee -a "$out/judge.log"
    fi
    exit "$status"
    ;;
*)
    sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
