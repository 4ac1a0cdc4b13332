#!/bin/bash
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt
( time LOG_DIR=$OUT/gpu-logs timeout 330 .gpu/gt/gpu-tests.sh run .gpu/gt ) > $OUT/gpu-tests.txt 2>&1; echo "gpu tests rc $?" >> $OUT/gpu-tests.txt
grep -E "test result|FAILED|panicked|rc " $OUT/gpu-tests.txt | tail -20
rm -f $OUT/gpu-logs/serve.log
timeout 120 python3 .gpu/front_check3.py > $OUT/front3.txt 2>&1; echo "front3 rc $?" >> $OUT/front3.txt
cat $OUT/front3.txt | cut -c1-300
timeout 120 python3 .gpu/front_check2.py > $OUT/front.txt 2>&1; echo "front rc $?" >> $OUT/front.txt
tail -3 $OUT/front.txt | cut -c1-300
rm -rf $OUT/shimcache $OUT/shimcache3
export PINPOOL_JUDGE_PARTS=tests PINPOOL_JUDGE_TIMEOUT=240
( time scripts/torch-judge.sh run .gpu/libpinpool_torch.so $OUT/judge ) > $OUT/judge-stdout.txt 2>&1
grep -E 'FAIL|passed|failed' $OUT/judge-stdout.txt | tail -8
rm -rf $OUT/judge
