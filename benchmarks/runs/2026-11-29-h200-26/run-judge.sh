#!/bin/bash
# The judge's tests from the installed wheel (library and package), away from the tree's python/.
root="$(cd "$(dirname "$0")/.." && pwd)"
unset PINPOOL_TORCH_LIB PINPOOL_DEVICE_CONF
python3 -m pip install -q --no-deps --no-index --target /tmp/site $root/.gpu/wheel/*.whl > $OUT/install.txt 2>&1; echo "install rc $?" | tee -a $OUT/install.txt
ls -la /tmp/site/pinpool_torch/ | tee -a $OUT/install.txt | grep "\.so"
export PYTHONPATH=/tmp/site
export PINPOOL_JUDGE_PARTS=tests PINPOOL_JUDGE_TIMEOUT=200 PINPOOL_TORCH_CACHE=$OUT/shimwheel
( time $root/scripts/torch-judge.sh run installed $OUT/judge ) > $OUT/judge-installed-stdout.txt 2>&1
grep -E 'lib|FAIL|passed|failed' $OUT/judge-installed-stdout.txt | tail -6 | cut -c1-250
rm -rf $OUT/judge $OUT/shimwheel
