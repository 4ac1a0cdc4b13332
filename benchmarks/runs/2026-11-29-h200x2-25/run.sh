#!/bin/bash
# Two GPUs under the defaults: the GPU suite, copies and a split model (pinpool vs PyTorch),
# which GPUs hold a context of a process that uses GPU 1 only, and the judge's tests part.
cd "$(dirname "$0")/.."
G=.gpu
nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id --format=csv,noheader > $OUT/machine.txt
nvidia-smi topo -m > $OUT/topo.txt 2>&1
cat $OUT/machine.txt
( time LOG_DIR=$OUT/gpu-logs timeout 240 $G/gt/gpu-tests.sh run $G/gt ) > $OUT/gpu-tests.txt 2>&1; echo "gpu tests rc $?" >> $OUT/gpu-tests.txt
grep -E "test result|FAILED|panicked|rc |skipped" $OUT/gpu-tests.txt | tail -14 | cut -c1-200
rm -rf $OUT/gpu-logs
for m in torch pinpool; do
  timeout 120 python3 $G/two_gpu.py $m copies > $OUT/two-$m.txt 2>&1; echo "rc $?" >> $OUT/two-$m.txt
  timeout 60 python3 $G/two_gpu.py $m ctx > $OUT/ctx-$m.txt 2>&1; echo "rc $?" >> $OUT/ctx-$m.txt
  echo "== $m"; tail -8 $OUT/two-$m.txt | cut -c1-300; tail -4 $OUT/ctx-$m.txt | cut -c1-300
done
rm -rf $OUT/shim2gpu
export PINPOOL_JUDGE_PARTS=tests PINPOOL_JUDGE_TIMEOUT=200
( time scripts/torch-judge.sh run $G/libpinpool_torch.so $OUT/judge ) > $OUT/judge-stdout.txt 2>&1
grep -E 'two_devices|FAIL|passed|failed' $OUT/judge-stdout.txt | tail -6 | cut -c1-300
grep -rh "two_devices" $OUT/judge/*.json 2>/dev/null | head -3 | cut -c1-300
tar czf $OUT/judge.tgz -C $OUT judge && rm -rf $OUT/judge
