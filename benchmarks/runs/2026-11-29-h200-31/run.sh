#!/bin/bash
# 0e72392 (actors' mailboxes closed, miss and free in one file each): GPU suite,
# device_bench new vs base (3f55790) in turn, three times, the judge's tests part.
cd "$(dirname "$0")/.."
G=.gpu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt
( time LOG_DIR=$OUT/gpu-logs timeout 300 $G/gt2/gpu-tests.sh run $G/gt2 ) > $OUT/gpu-tests.txt 2>&1; echo "gpu tests rc $?" >> $OUT/gpu-tests.txt
grep -E "test result|FAILED|panicked|rc |stream_retired" $OUT/gpu-tests.txt | tail -14 | cut -c1-300
rm -f $OUT/gpu-logs/serve.log
mkdir -p /tmp/tr
for f in traces/*.trace.gz traces/open/*.trace.gz $G/traces/*.trace.gz; do [ -f $f ] && gunzip -c $f > /tmp/tr/$(basename $f .gz).txt; done
for i in 1 2 3; do
  timeout 100 $G/device_bench_25 --quick /tmp/tr/*.txt > $OUT/dev_new_$i.txt 2>&1
  timeout 100 $G/device_bench_new --quick /tmp/tr/*.txt > $OUT/dev_base_$i.txt 2>&1
done
grep -hE 'dev_miss_us|dev_pair_ns' $OUT/dev_new_1.txt $OUT/dev_base_1.txt | cut -c1-200
export PINPOOL_JUDGE_PARTS=tests PINPOOL_JUDGE_TIMEOUT=200
( time scripts/torch-judge.sh run $G/libpinpool_torch_25.so $OUT/judge ) > $OUT/judge-stdout.txt 2>&1
grep -E 'FAIL|passed|failed' $OUT/judge-stdout.txt | tail -5 | cut -c1-300
rm -rf $OUT/judge
timeout 120 python3 scripts/torch-side-streams.py pinpool $G/libpinpool_torch_25.so > $OUT/side-streams.txt 2>&1; echo "rc $?" >> $OUT/side-streams.txt
tail -4 $OUT/side-streams.txt | cut -c1-200
