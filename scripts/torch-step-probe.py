#!/usr/bin/env python3
"""Where a model's step time goes, with one allocator (on a GPU machine).

    python3 scripts/torch-step-probe.py [--model NAME] [--steps N] [--json PATH] MODE [LIB]

MODE is native, expandable (PyTorch's with expandable segments), async (cudaMallocAsync),
pinpool LIB (libpinpool_torch.so) or pluggable SO (scripts/pluggable-async.cpp, built).
NAME is one of the judge's models (scripts/torch_judge.py: gpt2_generate, bert_varlen,
resnet50_train, vit_b_16_infer; default resnet50_train).

Prints the step's median time (synchronised before and after) and the host's part of it
(until the step's calls return): where the two are equal, the step is bound by the CPU
that launches its work, and the allocator's own time adds to it. With pinpool, also its
misses, the time they took, driver calls, the time of its alloc and free calls, and the CPU
time of its own threads per step. Then `torch.profiler` tables of a few steps, by GPU time and by host time (NOPROF=1
skips them); --json writes the profile's rows (name, calls, self and total CPU µs, self
device µs) for comparing two allocators op by op. `cudnn.benchmark` off."""

import argparse
import json
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser(usage=__doc__)
ap.add_argument("--model", default="resnet50_train")
ap.add_argument("--steps", type=int, default=0, help="timed steps (default: the judge's)")
ap.add_argument("--json")
ap.add_argument("mode", choices=("native", "expandable", "async", "pinpool", "pluggable"))
ap.add_argument("lib", nargs="?")
args = ap.parse_args()
mode = args.mode
if mode in ("pinpool", "pluggable") and not args.lib:
    sys.exit(__doc__)
if mode == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
elif mode == "async":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
elif mode == "pinpool":
    os.environ["PINPOOL_TORCH_CALL_TIMES"] = "1"
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import pinpool_torch

    pinpool_torch.enable(args.lib)
elif mode == "pluggable":
    import torch

    a = torch.cuda.memory.CUDAPluggableAllocator(args.lib, "async_alloc", "async_free")
    torch.cuda.memory.change_current_allocator(a)

import torch
from torch_judge import bench_models, pinpool_counts

torch.backends.cudnn.benchmark = False
dev = torch.device("cuda:0")
models = bench_models(dev)
if args.model not in models:
    sys.exit(f"no model {args.model!r}; one of {', '.join(models)}")
build, step, warmup, steps = models[args.model]
steps = args.steps or steps
state = build()


def counts():
    return pinpool_counts() if mode == "pinpool" else None


for i in range(warmup):
    step(state, i)
torch.cuda.synchronize()
before = counts()
total, host = [], []
for i in range(warmup, warmup + steps):
    torch.cuda.synchronize()
    s = time.perf_counter()
    step(state, i)
    c = time.perf_counter()
    torch.cuda.synchronize()
    total.append(time.perf_counter() - s)
    host.append(c - s)
print(
    f"{args.model} {mode}: step median {1e3 * statistics.median(total):.2f} ms (min {1e3 * min(total):.2f}); "
    f"host part median {1e3 * statistics.median(host):.2f} ms; {steps} steps",
    flush=True,
)
if before is not None:
    after = counts()
    print("per step:", {k: round((after[k] - before[k]) / steps, 3) for k in after}, flush=True)
if os.environ.get("NOPROF"):
    sys.exit(0)
from torch.profiler import ProfilerActivity, profile

profiled = min(3, steps)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(profiled):
        step(state, warmup + i)
    torch.cuda.synchronize()
table = prof.key_averages()
print(table.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
if args.json:
    rows = [{"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
             "cpu_us": e.cpu_time_total, "self_device_us": getattr(e, "self_device_time_total", 0)}
            for e in table]
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "mode": mode, "profiled_steps": profiled, "rows": rows}, f)
