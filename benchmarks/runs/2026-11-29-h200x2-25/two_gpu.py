import os, sys, subprocess, time
sys.path.insert(0, "python")
os.environ["PINPOOL_TORCH_LIB"] = os.path.abspath(".gpu/libpinpool_torch.so")
os.environ["PINPOOL_TORCH_CACHE"] = os.path.join(os.environ.get("OUT", "/tmp"), "shim2gpu")
mode, what = sys.argv[1], sys.argv[2]
import torch
if mode == "pinpool":
    import pinpool_torch
    print("flavour", pinpool_torch.enable()["shim"]["flavour"])
if what == "ctx":
    torch.cuda.set_device(1)

def contexts():
    idx = dict(l.split(", ") for l in subprocess.check_output(
        ["nvidia-smi", "--query-gpu=pci.bus_id,index", "--format=csv,noheader"], text=True).split("\n") if l)
    apps = subprocess.check_output(["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid,used_memory",
                                    "--format=csv,noheader"], text=True)
    mine = [l.split(", ") for l in apps.split("\n") if l and l.split(", ")[1] == str(os.getpid())]
    return sorted((idx.get(b, b), m) for b, _, m in mine)

if what == "ctx":
    x = torch.randn(1 << 20, device="cuda")
    y = x * 2
    torch.cuda.synchronize()
    print("current device", torch.cuda.current_device(), "allocated", torch.cuda.memory_allocated(1))
    print("contexts (gpu, memory):", contexts())
else:
    a = torch.arange(1 << 22, dtype=torch.float32, device="cuda:0")  # mapped before any peer access
    early1 = torch.full((1 << 20,), 3.0, device="cuda:1")
    b = a.to("cuda:1")
    c = (b * 2).to("cuda:0")
    print("copy 0->1->0 ok", bool(torch.equal(c, a * 2)))
    d = early1.to("cuda:0")
    print("copy of early 1->0 ok", bool(torch.all(d == 3.0).item()))
    s = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.stream(s):
        e = a.to("cuda:1", non_blocking=True)
    s.synchronize()
    print("non-blocking on a side stream ok", bool(torch.equal(e.cpu(), a.cpu())))
    torch.manual_seed(0)
    l1 = torch.nn.Linear(1024, 1024).to("cuda:0")
    l2 = torch.nn.Linear(1024, 16).to("cuda:1")
    x = torch.randn(256, 1024, device="cuda:0")
    for step in range(3):
        out = l2(torch.relu(l1(x)).to("cuda:1"))
        loss = out.float().pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in list(l1.parameters()) + list(l2.parameters()):
                p -= 0.01 * p.grad
                p.grad = None
    torch.cuda.synchronize()
    print("split model loss %r out-sum %r w1-sum %r" % (loss.item(), out.sum().item(), l1.weight.sum().item()))
    print("stats dev1 allocated", torch.cuda.memory_stats(1)["allocated_bytes.all.current"] > 0,
          "max_memory_allocated(1)", torch.cuda.max_memory_allocated(1) > 0)
    print("contexts (gpu, memory):", contexts())
