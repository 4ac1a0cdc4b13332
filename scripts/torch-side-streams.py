#!/usr/bin/env python3
"""Side streams across torch.cuda.empty_cache(), on pinpool or on PyTorch's allocator.

    python3 scripts/torch-side-streams.py pinpool|torch [LIB]

Four side streams each compute on a tensor in six rounds, with empty_cache() after each
round, then two more calls with the streams unused. Prints, per round, the threads of
pinpool's device pool actors (named `pinpool-0, ...`) before and after the call, then the
sum of the results and `allocation.all.allocated` (to compare with PyTorch's allocator), and
the median time of the first op on each side stream after a call. LIB: the plug-in library
(default: `PINPOOL_TORCH_LIB`, else the one `pinpool_torch` bundles).
"""
import os
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "pinpool"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
if len(sys.argv) > 2:
    os.environ["PINPOOL_TORCH_LIB"] = os.path.abspath(sys.argv[2])
import torch  # noqa: E402

if mode == "pinpool":
    import pinpool_torch

    pinpool_torch.enable()


def pool_threads():
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().startswith("pinpool-0, ")
        except OSError:
            pass
    return n


torch.manual_seed(0)
x = torch.randn(1 << 22, device="cuda")
streams = [torch.cuda.Stream() for _ in range(4)]
total, first_us = 0.0, []
for r in range(6):
    outs = []
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            t0 = time.perf_counter()
            y = x * (r + 1)
            if r > 0:
                first_us.append((time.perf_counter() - t0) * 1e6)
            outs.append(y.sum())
        torch.cuda.current_stream().wait_stream(s)
    total += sum(o.item() for o in outs)
    del y, outs
    torch.cuda.synchronize()
    before = pool_threads()
    torch.cuda.empty_cache()
    time.sleep(0.05)
    print(f"round {r}: pool threads {before} -> {pool_threads()}, reserved {torch.cuda.memory_reserved()}")
for k in range(2):
    torch.cuda.empty_cache()
    time.sleep(0.05)
    print(f"streams unused, empty_cache {k + 1}: pool threads {pool_threads()}")
stats = torch.cuda.memory_stats()
print("total", repr(total), "allocation.all.allocated", stats.get("allocation.all.allocated"))
first_us.sort()
print(f"first op on a side stream after empty_cache, median {first_us[len(first_us) // 2]:.0f} us")
