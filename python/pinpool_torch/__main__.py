"""`python -m pinpool_torch`: what pinpool_torch finds here, without changing anything in
PyTorch: the library (and whether it has CUDA support), the settings, the devices, PyTorch
and the shim. Exits 0 when the library loads and the settings are valid (no CUDA device is a
report, not a failure), 1 when the library cannot be used, 2 for a malformed setting."""

import os
import sys

import pinpool_torch as pt


def line(what, value):
    print(f"{what + ':':<14}{value}")


def main():
    try:
        path = pt.library_path()
        line("library", path)
        line("cuda support", "yes" if pt.cuda_support() else "no (built without --features cuda)")
    except OSError as e:
        line("library", f"unusable: {e}")
        return 1
    try:
        line("settings", pt.settings())
    except ValueError as e:
        line("settings", f"refused: {e}")
        return 2
    n = pt.library().pinpool_device_count()
    if n < 0:
        line("devices", f"no CUDA device ({pt.last_error()})")
    else:
        line("devices", n)
    try:
        import torch
    except ImportError:
        line("torch", "not installed (the shim and the graph-pool hooks need it)")
        return 0
    line("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    try:
        _, shim_path, flavour = pt._build_shim()
        line("shim", f"{shim_path} ({flavour})")
    except Exception as e:
        line("shim", f"cannot be built: {e}")
        line("graph hooks", "unknown (asked of the shim's pluggable allocator)")
    else:
        # A pluggable allocator object over the shim, not installed: what enable() asks.
        made = torch.cuda.memory.CUDAPluggableAllocator(
            shim_path, "pinpool_shim_alloc", "pinpool_shim_free"
        ).allocator()
        missing = [h for h in pt._GRAPH_HOOKS if not hasattr(made, h)]
        line("graph hooks", f"missing {', '.join(missing)}" if missing else "yes")
    peer = os.environ.get("PINPOOL_TORCH_PEER_ACCESS") == "1"
    line("peer access", "on" if peer else "off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
