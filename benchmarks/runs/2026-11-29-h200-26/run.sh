#!/bin/bash
# The wheel as a user installs it: a fresh virtual environment over the host's PyTorch, the
# wheel installed (no network), then the issue's one-liner and the front's checks, away from
# the checkout and with no PINPOOL_TORCH_LIB.
root="$(cd "$(dirname "$0")/.." && pwd)"
unset PINPOOL_TORCH_LIB PINPOOL_DEVICE_CONF
# Into a folder of its own beside the PyTorch environment's packages (the host's python3 has
# PyTorch in a virtual environment of its own).
python3 -m pip install -q --no-deps --no-index --target /tmp/site $root/.gpu/wheel/*.whl > $OUT/venv.txt 2>&1; echo "install rc $?" | tee -a $OUT/venv.txt
export PYTHONPATH=/tmp/site
cd /tmp
export PINPOOL_TORCH_CACHE=$OUT/shimwheel
( time python3 -c "import pinpool_torch; pinpool_torch.enable(); import torch; torch.zeros(1, device='cuda'); print('one-liner ok', pinpool_torch.library_path())" ) > $OUT/oneliner.txt 2>&1; echo "rc $?" >> $OUT/oneliner.txt
cat $OUT/oneliner.txt | cut -c1-300
python3 -m pinpool_torch > $OUT/report.txt 2>&1; echo "rc $?" >> $OUT/report.txt; cat $OUT/report.txt | cut -c1-200
sed -e 's|^sys.path.insert(0, "python")||' -e 's|^os.environ\["PINPOOL_TORCH_LIB"\].*||' $root/.gpu/front_check3.py > /tmp/fc3.py
sed -i 's|lib = ctypes.CDLL(os.environ\["PINPOOL_TORCH_LIB"\])|lib = ctypes.CDLL(pinpool_torch.library_path())|' /tmp/fc3.py
python3 /tmp/fc3.py > $OUT/front3-wheel.txt 2>&1; echo "rc $?" >> $OUT/front3-wheel.txt; cat $OUT/front3-wheel.txt | cut -c1-200
rm -rf $OUT/shimwheel $OUT/shimcache3
