import os, sys, time, ctypes
sys.path.insert(0, "python")
os.environ["PINPOOL_TORCH_LIB"] = os.path.abspath(".gpu/libpinpool_torch.so")
os.environ["PINPOOL_TORCH_CACHE"] = os.path.join(os.environ.get("OUT", "/tmp"), "shimcache3")
import torch, pinpool_torch
info = pinpool_torch.enable()
print("torch", torch.__version__, "shim", info["shim"]["flavour"])
a = torch.arange(1 << 22, dtype=torch.float32, device="cuda")
b = torch.empty_like(a)
b.copy_(a)  # a device-to-device copy: the front's memcpyAsync
torch.cuda.synchronize()
print("copy ok", bool(torch.equal(a, b)))
c = a[1::2].contiguous(); d = torch.empty_like(c); d.copy_(c); torch.cuda.synchronize()
print("strided copy ok", bool(torch.equal(c, d)))
lib = ctypes.CDLL(os.environ["PINPOOL_TORCH_LIB"])
lib.pinpool_enable_peer_access.argtypes = [ctypes.c_int, ctypes.c_int]
print("peer 0->0", lib.pinpool_enable_peer_access(0, 0), "peer 0->5", lib.pinpool_enable_peer_access(0, 5))
buf = ctypes.create_string_buffer(512); lib.pinpool_last_error(buf, 512); print("last error:", buf.value.decode()[:200])
print("memory_allocated", torch.cuda.memory_allocated(), "max", torch.cuda.max_memory_allocated())
print("device count", torch.cuda.device_count(), "current", torch.cuda.current_device())
