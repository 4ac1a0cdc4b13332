import os, sys, time
sys.path.insert(0, "python")
os.environ["PINPOOL_TORCH_LIB"] = os.path.abspath(".gpu/libpinpool_torch.so")
os.environ["PINPOOL_TORCH_CACHE"] = os.path.join(os.environ.get("OUT", "/tmp"), "shim2gpu")
import torch, pinpool_torch
pinpool_torch.enable()

def fresh_maps(n=40, mib=64):
    # Each round: the cache emptied, then n fresh blocks (each a map call with its access grant).
    times = []
    for _ in range(5):
        torch.cuda.empty_cache(); torch.cuda.synchronize()
        t = time.perf_counter()
        xs = [torch.empty(mib << 20, dtype=torch.uint8, device="cuda:0") for _ in range(n)]
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n * 1e6)
        del xs
    times.sort()
    return times[len(times) // 2]

held = torch.ones(1 << 26, device="cuda:0")  # 256 MiB mapped before peer access
before = fresh_maps()
t = time.perf_counter(); y = held.to("cuda:1"); torch.cuda.synchronize(); first_copy = (time.perf_counter() - t) * 1e3
t = time.perf_counter(); y2 = held.to("cuda:1"); torch.cuda.synchronize(); second_copy = (time.perf_counter() - t) * 1e3
after = fresh_maps()
print(f"fresh 64 MiB block on GPU 0 (median of 5 rounds of 40), us: before peer access {before:.0f}, after {after:.0f}")
print(f"first copy 0->1 of 256 MiB (enables peer access, opens what was mapped) ms {first_copy:.1f}; second {second_copy:.1f}")
print("ok", bool(torch.equal(y.cpu()[:10], held.cpu()[:10])))
