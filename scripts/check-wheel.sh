#!/usr/bin/env bash
# Builds the pinpool-torch wheel (`pip wheel ./python`), installs it into a fresh virtual
# environment and checks it without PyTorch and without a GPU: import, the bundled library
# (with CUDA support), `python -m pinpool_torch` reporting no CUDA device cleanly, and a bad
# PINPOOL_DEVICE_CONF refused. CI runs it; `SETUPTOOLS_RUST_CARGO_PROFILE` picks the cargo
# profile (default here: dev, to reuse the build of the checks before it).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
export SETUPTOOLS_RUST_CARGO_PROFILE="${SETUPTOOLS_RUST_CARGO_PROFILE:-dev}"
"$py" -m pip wheel -q --no-deps -w "$work/wheels" ./python
"$py" -m pip install -q "$work"/wheels/pinpool_torch-*.whl
# Away from the checkout, so that only the installed package can be imported.
cd "$work"
unset PINPOOL_TORCH_LIB PINPOOL_DEVICE_CONF
"$py" - <<'PY'
import os
import pinpool_torch as p

lib = p.library_path()
assert os.path.dirname(lib) == os.path.dirname(p.__file__), f"not the bundled library: {lib}"
assert p.cuda_support(), "the wheel's library has no CUDA support"
print("bundled:", lib)
PY
"$py" -m pinpool_torch | tee report.txt
grep -q "^devices: *no CUDA device" report.txt || grep -q "^devices: *[0-9]" report.txt
if PINPOOL_DEVICE_CONF=expandable_segment:true "$py" -m pinpool_torch >bad.txt 2>&1; then
  echo "a bad PINPOOL_DEVICE_CONF was accepted:"; cat bad.txt; exit 1
fi
grep -q "valid keys" bad.txt
echo "wheel ok"
