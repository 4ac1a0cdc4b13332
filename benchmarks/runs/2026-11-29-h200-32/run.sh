#!/bin/bash
# device_bench --quick, 7ec11a9 against 3f55790, six times each in turn (no traces).
cd "$(dirname "$0")/.."
G=.gpu
for i in 1 2 3 4 5 6; do
  timeout 60 $G/device_bench_25 --quick > $OUT/dev_new_$i.txt 2>&1
  timeout 60 $G/device_bench_new --quick > $OUT/dev_base_$i.txt 2>&1
done
for f in $OUT/dev_*; do echo "$(basename $f) $(grep -E 'dev_pair_ns size=4096|dev_pair_with_record_ns|dev_pair_with_record_raw|dev_async_pair|dev_miss_us gap_us=0' $f | awk '{print $NF}' | tr '\n' ' ')"; done
