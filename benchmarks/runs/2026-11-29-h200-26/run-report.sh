#!/bin/bash
cd "$(dirname "$0")/.."
export PINPOOL_TORCH_LIB=$PWD/.gpu/libpinpool_torch.so PINPOOL_TORCH_CACHE=$OUT/shimreport PYTHONPATH=$PWD/python
python3 -m pinpool_torch > $OUT/report.txt 2>&1; echo "rc $?" >> $OUT/report.txt; cat $OUT/report.txt | cut -c1-200
python3 -c "import pinpool_torch, torch; pinpool_torch.enable(); x = torch.ones(4, device='cuda'); print('enable after the report ok', x.sum().item())" 2>&1 | tail -2
rm -rf $OUT/shimreport
