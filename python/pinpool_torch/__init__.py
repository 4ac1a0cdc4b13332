"""pinpool as PyTorch's CUDA allocator.

    import pinpool_torch
    pinpool_torch.enable()          # before anything touches CUDA
    import torch
    x = torch.randn(1024, 1024, device="cuda")   # allocated by pinpool
    print(pinpool_torch.memory_stats()["allocated_bytes.all.current"])

With an external allocator, PyTorch's own statistics calls (torch.cuda.memory_stats,
memory_reserved, max_memory_allocated, memory._snapshot) raise: use the functions of this
module instead. See docs/torch.md.
"""

import ctypes
import glob
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import warnings

__all__ = [
    "LibraryError",
    "enable",
    "enabled",
    "pluggable_allocator",
    "library",
    "library_path",
    "cuda_support",
    "settings",
    "graph_hooks",
    "shim",
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "empty_cache",
    "record_memory_history",
    "dump_snapshot",
    "last_error",
]

_LIB_NAME = "libpinpool_torch.so"
_lib = None
_pluggable = None
_hooks = None  # None: not tried; True: installed; a string: why not


class LibraryError(OSError):
    """The shared library cannot be found, loaded or used (the message names the path)."""


def _library_source(path=None):
    """Where the library should be, and who said so: (path, origin)."""
    if path:
        return os.path.abspath(os.fspath(path)), "the path passed to pinpool_torch"
    env = os.environ.get("PINPOOL_TORCH_LIB")
    if env:
        return os.path.abspath(env), "PINPOOL_TORCH_LIB"
    here = os.path.dirname(os.path.abspath(__file__))
    # The copy `pip install` put in the package (named with Python's extension suffix).
    bundled = sorted(glob.glob(os.path.join(here, "libpinpool_torch*.so")))
    if bundled:
        return bundled[0], "the package's own copy"
    for candidate in (
        os.path.join(here, "..", _LIB_NAME),
        os.path.join(here, "..", "..", "target", "release", _LIB_NAME),
    ):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate), "the repository's build"
    raise LibraryError(
        f"{_LIB_NAME} not found next to the pinpool_torch package or in the repository's "
        "target/release: install the package with `pip install ./python`, or build it with "
        "`cargo build --release -p pinpool-torch --features cuda` and pass its path to "
        "pinpool_torch.enable(path) or set PINPOOL_TORCH_LIB"
    )


def library_path(path=None):
    """Where the shared library is: `path`, else $PINPOOL_TORCH_LIB, else next to this
    package, else the repository's target/release. A path given (or set) that names no file
    is a `LibraryError` naming it."""
    found, origin = _library_source(path)
    if not os.path.isfile(found):
        raise LibraryError(f"{origin} names {found}, which is not a file")
    return found


# The library's C entry points: name, result type, argument types.
_C = ctypes
_SIGNATURES = [
    ("pinpool_alloc", _C.c_void_p, [_C.c_size_t, _C.c_int, _C.c_void_p]),
    ("pinpool_free", None, [_C.c_void_p, _C.c_size_t, _C.c_int, _C.c_void_p]),
    ("pinpool_record_stream", None, [_C.c_void_p, _C.c_void_p]),
    ("pinpool_empty_cache", None, []),
    ("pinpool_memory_fraction", None, [_C.c_double, _C.c_int]),
    ("pinpool_init", _C.c_int, []),
    ("pinpool_cuda_support", _C.c_int, []),
    ("pinpool_settings", _C.c_int64, [_C.c_char_p, _C.c_size_t]),
    ("pinpool_device_count", _C.c_int, []),
    ("pinpool_memory_stats", _C.c_int64, [_C.c_int, _C.c_char_p, _C.c_size_t]),
    ("pinpool_reserved_bytes", _C.c_int64, [_C.c_int]),
    ("pinpool_reset_peak_stats", _C.c_int, [_C.c_int]),
    ("pinpool_reset_accumulated_stats", _C.c_int, [_C.c_int]),
    ("pinpool_record_history", _C.c_int, [_C.c_int, _C.c_size_t, _C.c_int, _C.c_int, _C.c_char_p]),
    ("pinpool_dump_snapshot", _C.c_int, [_C.c_char_p]),
    ("pinpool_end_allocate_to_pool", _C.c_int, [_C.c_int, _C.c_uint64, _C.c_uint64]),
    ("pinpool_release_pool", _C.c_int, [_C.c_int, _C.c_uint64, _C.c_uint64]),
    ("pinpool_last_error", _C.c_size_t, [_C.c_char_p, _C.c_size_t]),
    ("pinpool_failures", _C.c_size_t, []),
]


def _load(path=None):
    global _lib
    if _lib is not None:
        return _lib
    found = library_path(path)
    try:
        lib = ctypes.CDLL(found)
    except OSError as e:
        raise LibraryError(f"cannot load {found} as pinpool's library: {e}") from e
    missing = [name for name, _, _ in _SIGNATURES if not hasattr(lib, name)]
    if missing:
        raise LibraryError(
            f"{found} is not a pinpool-torch library of this version (it lacks "
            f"{', '.join(missing)}): build it again from this source"
        )
    for name, res, args in _SIGNATURES:
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    _lib = lib
    return lib


def cuda_support(path=None):
    """Whether the library was built with CUDA support (the `cuda` feature)."""
    return _load(path).pinpool_cuda_support() == 1


_CONF_VAR = "PINPOOL_DEVICE_CONF"


def settings(path=None):
    """The settings the allocator starts with, in `PINPOOL_DEVICE_CONF`'s form: the plug-in's
    defaults with the variable's keys over them. A malformed variable (an unknown key, a bad
    value) is a `ValueError` saying what is wrong (an unknown key: every valid one)."""
    lib = _load(path)
    n = lib.pinpool_settings(None, 0)
    if n >= 0:
        buf = ctypes.create_string_buffer(n + 1)
        n = lib.pinpool_settings(buf, len(buf))
    if n < 0:
        reason = last_error().removeprefix("pinpool: settings: ")
        raise ValueError(f"{_CONF_VAR}: {reason}")
    return buf.value.decode()


def _conf_value(value):
    """A Python value as a `PINPOOL_DEVICE_CONF` value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, dict):  # roundup_power2_divisions={256: 1, ">": 4}
        return "[" + ",".join(f"{k}:{v}" for k, v in value.items()) + "]"
    return str(value)


def _split_conf(text):
    """The `key:value` entries of a `PINPOOL_DEVICE_CONF` string (commas inside brackets
    kept), as (key, entry) pairs."""
    entries, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth <= 0:
            entry = text[start:i].strip()
            if entry:
                entries.append((entry.split(":", 1)[0].strip(), entry))
            start = i + 1
    return entries


def _apply_settings(given):
    """Sets `PINPOOL_DEVICE_CONF` to its value with the keys `given` (keyword arguments of
    `enable`) set over it."""
    if not given:
        return
    kept = [entry for key, entry in _split_conf(os.environ.get(_CONF_VAR, "")) if key not in given]
    kept += [f"{key}:{_conf_value(value)}" for key, value in given.items()]
    os.environ[_CONF_VAR] = ",".join(kept)


def _require_cuda(path=None):
    if not cuda_support(path):
        raise RuntimeError(
            f"{library_path(path)} was built without CUDA support: every allocation would "
            "fail. Build it with `cargo build --release -p pinpool-torch --features cuda` "
            "(or install the package with `pip install ./python`)"
        )


def library():
    """The loaded library (ctypes), loading it if needed."""
    return _load()


def last_error():
    """The calling thread's last error of the library ('' if none)."""
    lib = _load()
    buf = ctypes.create_string_buffer(1024)
    n = lib.pinpool_last_error(buf, len(buf))
    return buf.raw[: min(n, len(buf) - 1)].decode(errors="replace")


def _address(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


_GRAPH_HOOKS = ("set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool")

# What the shim calls, in the order pinpool_shim_install takes them (shim.cpp).
_ENTRY_POINTS = (
    "pinpool_alloc",
    "pinpool_free",
    "pinpool_last_error",
    "pinpool_begin_allocate_to_pool",
    "pinpool_end_allocate_to_pool",
    "pinpool_release_pool",
    "pinpool_record_stream",
    "pinpool_empty_cache",
    "pinpool_memory_fraction",
    "pinpool_stats_values",
    "pinpool_largest_block",
    "pinpool_reset_peak_stats",
    "pinpool_reset_accumulated_stats",
    "pinpool_last_error_is_oom",
    "pinpool_snapshot",
    "pinpool_record_history",
    "pinpool_enable_peer_access",
)


def pluggable_allocator(path=None):
    """A `torch.cuda.memory.CUDAPluggableAllocator` on pinpool, with every hook wired
    (for `torch.cuda.MemPool(pluggable_allocator().allocator())` as well as for `enable`).

    Its alloc and free go through the shim (shim.cpp, built here once and cached), which
    turns pinpool's NULL into PyTorch's out-of-memory exception and carries the graph-pool
    hooks. Without the shim, or without the hooks (a PyTorch too old to take them), there is
    no fallback: a NULL PyTorch does not check, or a graph capture whose allocations go to the
    ordinary pools, would corrupt memory silently. Both are a `RuntimeError` saying why, and
    so is a library built without CUDA support."""
    global _pluggable, _hooks
    if _pluggable is not None:
        return _pluggable
    import torch

    lib = _load(path)
    try:
        shim, shim_path, flavour = _build_shim()
    except Exception as e:
        _shim_info.update(error=f"{type(e).__name__}: {e}")
        raise RuntimeError(
            "pinpool_torch could not build or load its shim (shim.cpp, compiled with g++ or "
            "$CXX into $PINPOOL_TORCH_CACHE or ~/.cache/pinpool_torch), without which PyTorch "
            f"would get NULL on out of memory and graph capture would not reach pinpool: {e}"
        ) from e
    if flavour == "plain":
        warnings.warn(
            "pinpool_torch's shim was built without PyTorch's headers: out of memory raises "
            f"RuntimeError instead of torch.OutOfMemoryError ({_shim_info.get('fallback_reason')})",
            RuntimeWarning,
            stacklevel=2,
        )
    if flavour != "front":
        warnings.warn(
            "pinpool_torch's shim was built without its allocator front (PyTorch's and CUDA's "
            "headers, libtorch_cuda): after enable(), torch.cuda.memory_stats(), "
            "max_memory_allocated() and cudnn.benchmark raise as under any pluggable allocator; "
            f"pinpool_torch.memory_stats() has the figures ({_shim_info.get('fallback_reason')})",
            RuntimeWarning,
            stacklevel=2,
        )
    entry = (ctypes.c_void_p * len(_ENTRY_POINTS))(*[_address(lib, name) for name in _ENTRY_POINTS])
    hooks_out = (ctypes.c_uint64 * 3)()
    shim.pinpool_shim_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    shim.pinpool_shim_install.restype = ctypes.c_int
    shim.pinpool_shim_install(ctypes.cast(entry, ctypes.c_void_p), ctypes.cast(hooks_out, ctypes.c_void_p))
    _shim_info.update(path=shim_path, flavour=flavour)
    globals()["_shim"] = shim  # keep it loaded
    alloc = torch.cuda.memory.CUDAPluggableAllocator(shim_path, "pinpool_shim_alloc", "pinpool_shim_free")
    hooks = alloc.allocator()
    missing = [h for h in _GRAPH_HOOKS if not hasattr(hooks, h)]
    if missing:
        _hooks = f"this PyTorch has no {', '.join(missing)}"
        raise RuntimeError(
            f"this PyTorch ({getattr(torch, '__version__', '?')}) cannot hand pinpool its "
            f"graph-pool hooks (no {', '.join(missing)}): CUDA graph captures would take "
            "memory from the ordinary pools. Use a newer PyTorch"
        )
    _require_cuda(path)
    hooks.set_record_stream_fn(_address(lib, "pinpool_record_stream"))
    hooks.set_reset_fn(_address(lib, "pinpool_empty_cache"))
    hooks.set_memory_fraction_fn(_address(lib, "pinpool_memory_fraction"))
    hooks.set_begin_allocate_to_pool(hooks_out[0])
    hooks.set_end_allocate_to_pool_fn(hooks_out[1])
    hooks.set_release_pool(hooks_out[2])
    _hooks = True
    _pluggable = alloc
    return alloc


_shim_info = {}


def shim():
    """How the shim was built: its path and flavour ('c10': PyTorch's out-of-memory
    exception; 'plain': RuntimeError), or the error that left it out."""
    return dict(_shim_info)


def _cuda_include_dirs(cuda_home, sites):
    """CUDA's runtime headers for the allocator front: CUDA_HOME's `include` folder, else the
    folders PyTorch's pip dependencies install (`nvidia/*/include` under each of `sites`),
    which must hold `cuda_runtime_api.h`. PyTorch's pip dependencies do not install the `crt`
    headers it includes (nvcc's own): then pinpool's host-only stand-ins for the two a host
    compile reads (`hostonly/crt`, the same type layouts) complete them. RuntimeError when
    there is no `cuda_runtime_api.h`."""
    if cuda_home and os.path.isdir(os.path.join(cuda_home, "include")):
        return [os.path.join(cuda_home, "include")]
    runtime, crt = "cuda_runtime_api.h", os.path.join("crt", "host_defines.h")
    found = []
    for where in sites:
        for inc in sorted(glob.glob(os.path.join(where, "nvidia", "*", "include"))):
            if inc not in found and any(os.path.isfile(os.path.join(inc, w)) for w in (runtime, crt)):
                found.append(inc)
    has = lambda w: any(os.path.isfile(os.path.join(d, w)) for d in found)
    if not has(runtime):
        raise RuntimeError(
            "no CUDA headers for the allocator front: set CUDA_HOME to a CUDA toolkit, or "
            f"pip install the CUDA runtime's headers (missing: {runtime})"
        )
    if not has(crt):
        found.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostonly"))
    return found


def _torch_build_flags(front):
    """Compiler flags for the installed PyTorch: its include and library folders and C++ ABI
    flag; with `front`, also CUDA's headers and the libraries the allocator front links."""
    import torch
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    includes = list(cpp_extension.include_paths())
    libs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
    flags = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DPINPOOL_WITH_C10"]
    link = ["-lc10"]
    if front:
        import site

        sites = [os.path.dirname(os.path.dirname(torch.__file__))] + site.getsitepackages()
        includes += _cuda_include_dirs(getattr(cpp_extension, "CUDA_HOME", None), sites)
        flags.append("-DPINPOOL_WITH_FRONT")
        link = ["-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"]
    flags += [f"-I{d}" for d in includes]
    flags += [f"-L{d}" for d in libs] + [f"-Wl,-rpath,{d}" for d in libs] + link
    return flags


def _build_shim():
    """Compiles shim.cpp, once per source, compiler and PyTorch (cached), and loads it:
    (ctypes lib, path, flavour). Flavours, best first: 'front' (PyTorch's and CUDA's headers,
    linked with libtorch_cuda: PyTorch's own memory statistics calls and cuDNN's benchmark
    mode work), 'c10' (PyTorch's headers: its out-of-memory exception), 'plain'."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim.cpp")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX) to build pinpool_torch's shim")
    cache = os.environ.get("PINPOOL_TORCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "pinpool_torch"
    )
    os.makedirs(cache, exist_ok=True)
    with open(src, "rb") as f:
        source = f.read()
    errors = []
    attempts = []
    for flavour, front in (("front", True), ("c10", False)):
        try:
            attempts.append((flavour, _torch_build_flags(front)))
        except Exception as e:
            errors.append(f"{flavour}: {type(e).__name__}: {e}")
    attempts.append(("plain", []))
    for flavour, flags in attempts:
        key = hashlib.sha256(source + cxx.encode() + " ".join(flags).encode()).hexdigest()[:16]
        out = os.path.join(cache, f"shim-{flavour}-{key}.so")
        failed = out + ".failed"
        if os.path.isfile(failed):
            with open(failed) as f:
                errors.append(f"{flavour}: {f.read().strip()[-300:]} (cached)")
            continue
        if not os.path.isfile(out):
            fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
            os.close(fd)
            cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-o", tmp, src] + flags
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            if r.returncode != 0:
                os.unlink(tmp)
                with open(failed, "w") as f:
                    f.write(r.stderr[-4000:])
                errors.append(f"{flavour}: {r.stderr.strip()[-300:]}")
                continue
            os.replace(tmp, out)  # atomic: racing processes each write a whole file
        try:
            shim = ctypes.CDLL(out)
        except OSError as e:
            errors.append(f"{flavour}: {e}")
            continue
        if errors:
            _shim_info["fallback_reason"] = "; ".join(errors)
        return shim, out, flavour
    raise RuntimeError("; ".join(errors))


def graph_hooks():
    """True when CUDA graph capture is wired to pinpool's graph pools (always, once
    `enable` or `pluggable_allocator` succeeded: without them they raise); why not (a
    string) after they failed for want of them; None before."""
    return _hooks


def enable(path=None, peer_access=False, **settings_):
    """Makes pinpool PyTorch's CUDA allocator for this process. Call it before anything
    initialises CUDA (the first tensor on a GPU, torch.cuda.init(), ...): PyTorch can swap
    its allocator only then. Returns a dict: the library's path, the graph-pool hooks (True)
    and how the shim was built.

    It works fully or raises: a library that cannot be found or loaded (`LibraryError`,
    naming the path), one built without CUDA support, a shim that cannot be built, or a
    PyTorch without the graph-pool hooks (`RuntimeError`) leave PyTorch's allocator in
    place.

    `peer_access=True` (the same as PINPOOL_TORCH_PEER_ACCESS=1) gives every GPU access to
    the memory the others map from the start. With the allocator front (the shim's `front`
    flavour) PyTorch's own peer-access call reaches pinpool before its first copy between
    GPUs, so it is not needed; without the front, copies between GPUs
    (`tensor.to("cuda:1")`) need it. It makes every map call on a host of several GPUs
    dearer (docs/torch.md).

    Other keyword arguments are settings, the keys of `PINPOOL_DEVICE_CONF` (and of
    `PYTORCH_CUDA_ALLOC_CONF`), set over the variable's:
    `enable(expandable_segments=False, roundup_power2_divisions={256: 1, ">": 4})`. An
    unknown key or a bad value is a `ValueError` naming the valid keys."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "pinpool_torch.enable() must run before CUDA is initialised in this process "
            "(PyTorch swaps its allocator only before its first CUDA allocation)"
        )
    _apply_settings(settings_)
    settings(path)  # a malformed setting is a ValueError before anything changes
    if peer_access:
        os.environ["PINPOOL_TORCH_PEER_ACCESS"] = "1"
    alloc = pluggable_allocator(path)
    if _shim_info.get("flavour") == "front":
        # The shim's allocator front: the pluggable allocator with PyTorch's statistics calls
        # and cacheInfo answered by pinpool.
        why = ctypes.create_string_buffer(1024)
        _shim.pinpool_shim_enable.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        _shim.pinpool_shim_enable.restype = ctypes.c_int
        if _shim.pinpool_shim_enable(why, len(why)) != 0:
            raise RuntimeError(f"PyTorch refused pinpool's allocator: {why.value.decode(errors='replace')}")
    else:
        torch.cuda.memory.change_current_allocator(alloc)
    globals()["_enabled"] = True
    return {
        "library": library_path(path),
        "graph_hooks": _hooks,
        "shim": shim(),
        "settings": settings(path),
    }


def enabled():
    """Whether `enable` has run in this process."""
    return bool(globals().get("_enabled"))


def _device(device):
    if device is None:
        import torch

        return torch.cuda.current_device()
    if hasattr(device, "index"):
        return 0 if device.index is None else device.index
    return int(device)


def _check(status, what):
    if status < 0:
        raise RuntimeError(f"pinpool {what}: {last_error()}")
    return status


def memory_stats(device=None):
    """`torch.cuda.memory_stats` with pinpool: a dict with PyTorch's flat keys."""
    lib = _load()
    d = _device(device)
    n = _check(lib.pinpool_memory_stats(d, None, 0), "memory_stats")
    buf = ctypes.create_string_buffer(n + 1)
    _check(lib.pinpool_memory_stats(d, buf, len(buf)), "memory_stats")
    return json.loads(buf.value.decode())


def memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return _check(_load().pinpool_reserved_bytes(_device(device)), "memory_reserved")


def max_memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device=None):
    _check(_load().pinpool_reset_peak_stats(_device(device)), "reset_peak_memory_stats")


def reset_accumulated_memory_stats(device=None):
    _check(
        _load().pinpool_reset_accumulated_stats(_device(device)),
        "reset_accumulated_memory_stats",
    )


def empty_cache():
    """Gives every cached block back to the driver (torch.cuda.empty_cache() does the same
    once pinpool is enabled)."""
    _load().pinpool_empty_cache()


def record_memory_history(enabled=True, max_entries=100_000):
    """Turns pinpool's trace on (with each allocation's call site in pinpool) or off; with
    the allocator front, `torch.cuda.memory._record_memory_history` does the same without
    call sites."""
    _check(
        _load().pinpool_record_history(1 if enabled else 0, max_entries, 1, 0, None),
        "record_history",
    )


def dump_snapshot(path):
    """`torch.cuda.memory._dump_snapshot(path)` with pinpool: a pickle for
    pytorch.org/memory_viz."""
    _check(_load().pinpool_dump_snapshot(os.fsencode(os.fspath(path))), "dump_snapshot")
