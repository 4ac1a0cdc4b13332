#!/usr/bin/env python3
"""Where a ResNet-50 training step's time goes, with one allocator (on a GPU machine).

    python3 scripts/torch-step-probe.py native
    python3 scripts/torch-step-probe.py pinpool LIB        # libpinpool_torch.so
    python3 scripts/torch-step-probe.py pluggable SO       # scripts/pluggable-async.cpp, built

Prints the step's median time (synchronised before and after) and the host's part of it
(until the step's calls return): where the two are equal, the step is bound by the CPU
that launches its work, and the allocator's own time adds to it. With pinpool, also its
misses and driver calls per step. Then `torch.profiler` tables of three steps, by GPU time
and by host time (NOPROF=1 skips them). Batch 32, `cudnn.benchmark` off."""

import os
import statistics
import sys
import time

mode = sys.argv[1]
if mode == "pinpool":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import pinpool_torch

    pinpool_torch.enable(sys.argv[2])
elif mode == "pluggable":
    import torch

    a = torch.cuda.memory.CUDAPluggableAllocator(sys.argv[2], "async_alloc", "async_free")
    torch.cuda.memory.change_current_allocator(a)
elif mode != "native":
    sys.exit(__doc__)

import torch
from torch_judge import build_resnet

torch.backends.cudnn.benchmark = False
dev = torch.device("cuda:0")
model, opt = build_resnet(dev)
g = torch.Generator().manual_seed(1)
xs = [torch.randn(32, 3, 224, 224, generator=g).to(dev) for _ in range(2)]
ys = [torch.randint(0, 1000, (32,), generator=g).to(dev) for _ in range(2)]


def step(i):
    loss = torch.nn.functional.cross_entropy(model(xs[i % 2]), ys[i % 2])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def counts():
    if mode != "pinpool":
        return None
    st = pinpool_torch.memory_stats()
    return {k: st.get(k, 0) for k in ("num_misses", "num_device_alloc", "num_device_free", "num_device_remaps")}


for i in range(5):
    step(i)
torch.cuda.synchronize()
before = counts()
steps, total, host = 15, [], []
for i in range(steps):
    torch.cuda.synchronize()
    s = time.perf_counter()
    step(i)
    c = time.perf_counter()
    torch.cuda.synchronize()
    total.append(time.perf_counter() - s)
    host.append(c - s)
print(
    f"{mode}: step median {1e3 * statistics.median(total):.1f} ms (min {1e3 * min(total):.1f}); "
    f"host part median {1e3 * statistics.median(host):.1f} ms",
    flush=True,
)
if before is not None:
    after = counts()
    print("per step:", {k: round((after[k] - before[k]) / steps, 1) for k in after}, flush=True)
if os.environ.get("NOPROF"):
    sys.exit(0)
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
table = prof.key_averages()
print(table.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
