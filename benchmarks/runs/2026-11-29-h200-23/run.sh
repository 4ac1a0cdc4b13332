#!/bin/bash
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt
python3 -c "import torch, os, glob; d=os.path.dirname(os.path.dirname(torch.__file__)); print(glob.glob(d+'/nvidia/*/include')); print([glob.glob(p+'/crt/*')[:3] for p in glob.glob(d+'/nvidia/*/include')])" > $OUT/nvidia-includes.txt 2>&1
export CUDA_HOME=/nonexistent
PINPOOL_TORCH_CACHE=$OUT/shimpip timeout 120 python3 .gpu/front_check3.py > $OUT/front3-pip.txt 2>&1; echo "front3 pip-only rc $?" >> $OUT/front3-pip.txt
cat $OUT/front3-pip.txt | cut -c1-300
for f in $OUT/shimpip/*.failed; do [ -f "$f" ] && tail -c 1500 "$f"; done
timeout 120 python3 .gpu/front_check2.py > $OUT/front-pip.txt 2>&1; echo "front pip-only rc $?" >> $OUT/front-pip.txt
head -1 $OUT/front-pip.txt | cut -c1-300; tail -3 $OUT/front-pip.txt | cut -c1-300
rm -rf $OUT/shimcache $OUT/shimcache3 $OUT/shimpip
export PINPOOL_JUDGE_PARTS=tests PINPOOL_JUDGE_TIMEOUT=240
( time scripts/torch-judge.sh run .gpu/libpinpool_torch.so $OUT/judge ) > $OUT/judge-pip-stdout.txt 2>&1
grep -E 'FAIL|passed|failed|flavour' $OUT/judge-pip-stdout.txt | tail -8 | cut -c1-300
grep -rho '"flavour": *"[a-z0-9]*"' $OUT/judge 2>/dev/null | sort | uniq -c | head
rm -rf $OUT/judge
