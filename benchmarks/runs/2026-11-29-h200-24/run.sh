#!/bin/bash
# GPU suite, front checks, device_bench new (HEAD) against base (a6a3b3e) twice in turn, judge tests.
cd "$(dirname "$0")/.."
G=.gpu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt
( time LOG_DIR=$OUT/gpu-logs timeout 300 $G/gt/gpu-tests.sh run $G/gt ) > $OUT/gpu-tests.txt 2>&1; echo "gpu tests rc $?" >> $OUT/gpu-tests.txt
grep -E "test result|FAILED|panicked|rc " $OUT/gpu-tests.txt | tail -12
rm -f $OUT/gpu-logs/serve.log
timeout 120 python3 $G/front_check3.py > $OUT/front3.txt 2>&1; echo "front3 rc $?" >> $OUT/front3.txt
tail -3 $OUT/front3.txt | cut -c1-200
mkdir -p /tmp/tr
for f in traces/*.trace.gz traces/open/*.trace.gz $G/traces/*.trace.gz; do gunzip -c $f > /tmp/tr/$(basename $f .gz).txt; done
for i in 1 2; do
  timeout 100 $G/device_bench --quick /tmp/tr/*.txt > $OUT/dev_new_$i.txt 2>&1
  timeout 100 $G/base/device_bench --quick /tmp/tr/*.txt > $OUT/dev_base_$i.txt 2>&1
done
grep -hE 'dev_miss_us|dev_pair_ns' $OUT/dev_new_1.txt $OUT/dev_base_1.txt $OUT/dev_new_2.txt $OUT/dev_base_2.txt
rm -rf $OUT/shimcache3
export PINPOOL_JUDGE_PARTS=tests PINPOOL_JUDGE_TIMEOUT=200
( time scripts/torch-judge.sh run $G/libpinpool_torch.so $OUT/judge ) > $OUT/judge-stdout.txt 2>&1
grep -E 'FAIL|passed|failed' $OUT/judge-stdout.txt | tail -4
rm -rf $OUT/judge
