#!/usr/bin/env python3
"""PyTorch on pinpool, judged on a GPU machine (run through scripts/torch-judge.sh).

The driver (no CUDA in its own process) starts one worker process per configuration and
part, each with its own timeout, and compares what they write:

  results   GPT-2 small generating 64 tokens (batch 4), BERT-base over varied sequence
            lengths, ResNet-50 training steps (losses and gradients), ViT-B/16 inference and a
            CUDA-graph-captured forward pass replayed many times; deterministic algorithms,
            fixed seeds, random weights. Hashes of every output, native against pinpool
            (bit for bit); a second native run is the control where they differ.
  tests     a port of the allocator cases of PyTorch's test/test_cuda.py (record_stream,
            graph capture with private pools, MemPool with an external allocator, empty_cache,
            statistics, snapshots, out of memory), pass/fail with the reason.
  threads   two threads running models on two streams at once (on two GPUs when there are
            two): same hashes as native.
  bench     native, expandable_segments:True, backend:cudaMallocAsync and pinpool: per model,
            the peak of the driver's used memory while the model runs, above the level
            the worker started at (sampled every millisecond by a process of its own through
            NVML, or by a thread through cudaMemGetInfo without it; what the process still
            held from the models before counts, as "held before"), with ratios against the
            best of PyTorch's three, and each worker's own step times. The four run one after
            the other in PINPOOL_JUDGE_ROUNDS rounds (default 1), alternating their order: a
            model's figures are the median of the rounds'.
  lockstep  the step-time verdicts: the four configurations' workers all alive at once
            (PINPOOL_JUDGE_PROCS processes each, default 2, splitting the timed steps), each
            taking PINPOOL_JUDGE_TURN steps (default 3) in turn, the order rotating every
            turn, so that the host's drifting speed weighs on each alike; per model, the
            median step time against the fastest of PyTorch's three, and step by step the
            median of pinpool's time over that fastest configuration's step next to it.

PINPOOL_JUDGE_MODELS (comma-separated names: gpt2_generate, bert_varlen, resnet50_train,
vit_b_16_infer) limits bench and lockstep to those models; PINPOOL_JUDGE_PARTS
(comma-separated: info, results, tests, bench, lockstep, threads) runs only those parts;
PINPOOL_JUDGE_VARIANT (a PINPOOL_DEVICE_CONF, or several separated by ';') adds pinpool with
those settings to bench and lockstep as more configurations, "variant" (or "variant1",
"variant2", ...), shown beside the others and judged by nothing;
PINPOOL_JUDGE_CPU ("auto", the default: the fastest CPU of a short timed loop on each; a CPU
number; or "none") pins the main thread of every bench and lockstep worker to one CPU (see
timing_cpu).

Usage: torch_judge.py --lib LIB --out DIR [--budget SECONDS]
       torch_judge.py --worker PART --mode MODE --lib LIB --out DIR   (internal)
"""

import argparse
import hashlib
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback

MODES = {
    "native": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "pinpool": {},
}
TORCH_MODES = ("native", "expandable", "async")


def variant_modes(text):
    """The configurations PINPOOL_JUDGE_VARIANT names: PINPOOL_DEVICE_CONF settings for pinpool
    to run with beside its defaults, separated by ';', as {name: settings}: one is "variant",
    several are "variant1", "variant2", ..."""
    confs = [c.strip() for c in (text or "").split(";") if c.strip()]
    if len(confs) == 1:
        return {"variant": confs[0]}
    return {f"variant{i + 1}": c for i, c in enumerate(confs)}


# PINPOOL_JUDGE_VARIANT: pinpool's settings to run with beside its defaults in the head to
# head and the interleaved steps, for comparison only (see variant_modes).
VARIANTS = variant_modes(os.environ.get("PINPOOL_JUDGE_VARIANT"))
for _name, _conf in VARIANTS.items():
    MODES[_name] = {"PINPOOL_DEVICE_CONF": _conf}
# The configurations the head to head and the interleaved steps compare.
COMPARED = TORCH_MODES + ("pinpool",) + tuple(VARIANTS)
MIB = 1 << 20


def is_pinpool(mode):
    """Whether `mode` runs on pinpool (its defaults, or a variant)."""
    return mode == "pinpool" or mode in VARIANTS


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------


class Recorder:
    """A worker's results, rewritten to its JSON file after every entry (a crash keeps
    what came before it)."""

    def __init__(self, path):
        self.path = path
        self.data = {}

    def put(self, key, value):
        self.data[key] = value
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def setup_mode(mode, lib):
    """Runs before CUDA starts: installs pinpool when asked."""
    if is_pinpool(mode):
        import pinpool_torch

        info = pinpool_torch.enable(lib)
        print(f"pinpool enabled: {info}", flush=True)
        return info
    return {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def digest(*tensors):
    """sha256 over the bytes of the tensors (on the CPU, contiguous)."""
    import torch

    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:24]


def magnitude(*tensors):
    """The sum of absolute values in float64: how far apart two differing runs are."""
    import torch

    return float(sum(t.detach().double().abs().sum().item() for t in tensors if torch.is_floating_point(t)))


def deterministic():
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def cpu_gen(seed):
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return g


def build_gpt2(device):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config()).eval().to(device)
    return model


def run_gpt2(model, device, seed=2):
    import torch

    ids = torch.randint(0, 50257, (4, 16), generator=cpu_gen(seed)).to(device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )
    return out


def build_bert(device):
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(3)
    return BertModel(BertConfig()).eval().to(device)


BERT_LENGTHS = (7, 32, 64, 128, 255, 384, 512)


def run_bert(model, device, length, batch=4, seed=4):
    import torch

    ids = torch.randint(0, 30522, (batch, length), generator=cpu_gen(seed + length)).to(device)
    with torch.no_grad():
        return model(ids).last_hidden_state


def build_resnet(device):
    import torch
    import torchvision

    torch.manual_seed(5)
    model = torchvision.models.resnet50().to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def resnet_step(model, opt, device, step, batch):
    import torch

    g = cpu_gen(100 + step)
    x = torch.randn(batch, 3, 224, 224, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    opt.step()
    return loss, grads


def build_vit(device):
    import torch
    import torchvision

    torch.manual_seed(6)
    return torchvision.models.vit_b_16().eval().to(device)


def run_vit(model, device, batch, seed=7):
    import torch

    x = torch.randn(batch, 3, 224, 224, generator=cpu_gen(seed)).to(device)
    with torch.no_grad():
        return model(x)


def graph_model(device):
    import torch

    torch.manual_seed(8)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.GELU(),
        torch.nn.Linear(4096, 1024),
        torch.nn.LayerNorm(1024),
    ).to(device)


def run_graph(device, replays=200):
    """Captures a forward pass, replays it with changing inputs; returns the hashes and
    whether every replay matched eager execution."""
    import torch

    model = graph_model(device)
    inputs = [torch.randn(64, 1024, generator=cpu_gen(200 + i)).to(device) for i in range(10)]
    static_x = torch.zeros(64, 1024, device=device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        static_y = model(static_x)
    outs = []
    matches = True
    with torch.no_grad():
        for i in range(replays):
            static_x.copy_(inputs[i % 10])
            g.replay()
            if i % 20 == 0:
                outs.append(static_y.clone())
                eager = model(inputs[i % 10])
                matches = matches and bool(torch.equal(eager, static_y))
    torch.cuda.synchronize()
    del g
    return digest(*outs), matches


def worker_results(mode, rec):
    import torch

    deterministic()
    device = torch.device("cuda:0")

    def part(name, fn):
        t0 = time.time()
        try:
            rec.put(name, {"ok": True, "hashes": fn(), "seconds": round(time.time() - t0, 2)})
        except Exception as e:
            traceback.print_exc()
            rec.put(name, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        print(f"{name}: {time.time() - t0:.1f}s", flush=True)

    sums = {}

    def gpt2():
        model = build_gpt2(device)
        out = run_gpt2(model, device)
        with torch.no_grad():
            logits = model(out).logits
        sums["gpt2"] = magnitude(logits)
        return {"tokens": digest(out), "logits": digest(logits)}

    def bert():
        model = build_bert(device)
        outs = {n: run_bert(model, device, n) for n in BERT_LENGTHS}
        sums["bert"] = magnitude(*outs.values())
        return {str(n): digest(o) for n, o in outs.items()}

    def resnet():
        model, opt = build_resnet(device)
        h = {}
        for step in range(3):
            loss, grads = resnet_step(model, opt, device, step, batch=16)
            h[f"loss{step}"] = digest(loss)
            h[f"grads{step}"] = digest(*grads)
        h["params"] = digest(*model.parameters())
        sums["resnet50_train"] = magnitude(*model.parameters())
        return h

    def vit():
        out = run_vit(build_vit(device), device, batch=8)
        sums["vit_b_16"] = magnitude(out)
        return {"logits": digest(out)}

    def graph():
        if mode == "pinpool":
            import pinpool_torch

            if pinpool_torch.graph_hooks() is not True:
                raise RuntimeError(f"graph hooks unavailable: {pinpool_torch.graph_hooks()}")
        h, matches = run_graph(device)
        if not matches:
            raise AssertionError("a replay differed from eager execution")
        return {"replays": h}

    for name, fn in (("gpt2", gpt2), ("bert", bert), ("resnet50_train", resnet), ("vit_b_16", vit), ("cuda_graph", graph)):
        part(name, fn)
        rec.put("magnitudes", sums)
        torch.cuda.empty_cache()


def worker_threads(mode, rec):
    """Two threads, each on its own stream (and device, with two GPUs), at once."""
    import torch

    deterministic()
    two = torch.cuda.device_count() > 1
    dev_a = torch.device("cuda:0")
    dev_b = torch.device("cuda:1" if two else "cuda:0")
    rec.put("devices", 2 if two else 1)
    bert = build_bert(dev_a)
    vit = build_vit(dev_b)
    torch.cuda.synchronize(dev_a)
    torch.cuda.synchronize(dev_b)
    barrier = threading.Barrier(2)
    results = {}

    def thread_a():
        with torch.cuda.device(dev_a):
            s = torch.cuda.Stream(dev_a)
            barrier.wait()
            outs = []
            with torch.cuda.stream(s):
                for _ in range(3):
                    for n in BERT_LENGTHS:
                        outs.append(run_bert(bert, dev_a, n))
            s.synchronize()
            results["bert_thread"] = digest(*outs)

    def thread_b():
        with torch.cuda.device(dev_b):
            s = torch.cuda.Stream(dev_b)
            barrier.wait()
            outs = []
            with torch.cuda.stream(s):
                for i in range(6):
                    outs.append(run_vit(vit, dev_b, batch=4, seed=300 + i))
            s.synchronize()
            results["vit_thread"] = digest(*outs)

    errors = []

    def guard(fn):
        def run():
            try:
                fn()
            except Exception as e:
                traceback.print_exc()
                errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")
                try:
                    barrier.abort()
                except Exception:
                    pass

        return run

    ts = [threading.Thread(target=guard(f)) for f in (thread_a, thread_b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rec.put("errors", errors)
    rec.put("hashes", results)


def combine_rounds(rounds, models):
    """One configuration's bench results over several rounds: per model, the median of the
    rounds' peaks and allocator peaks, the median of every step time of every round, and
    each round's own median. A model counts only where every round measured it."""
    out = {k: v for k, v in (rounds[0] if rounds else {}).items() if not isinstance(v, dict) or k == "setup"}
    for model in models:
        rs = [r.get(model, {}) for r in rounds]
        if not rs or not all(r.get("ok") for r in rs):
            bad = next((r for r in rs if not r.get("ok")), {})
            out[model] = {"ok": False, "error": bad.get("error", "no result in some round")}
            continue
        times = [t for r in rs for t in r.get("times_ms", [r["median_ms"]])]
        combined = {"ok": True, "median_ms": round(statistics.median(times), 3),
                    "min_ms": min(r["min_ms"] for r in rs),
                    "round_medians_ms": [r["median_ms"] for r in rs]}
        # The peaks, and every per-step count the workers wrote (see `pinpool_counts`).
        per_step = sorted({k for r in rs for k in r if k.endswith("_per_step")})
        for key in ("peak_mib", "held_before_mib", "allocator_peak_reserved_mib", "allocator_peak_allocated_mib",
                    *per_step):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if vals:
                combined[key] = statistics.median(vals)
        out[model] = combined
    return out


# The sampler process: NVML only (no CUDA context of its own), polled every `period` seconds;
# on stdin, "reset" sets the peak to the current level, "peak" and "now" answer a number of
# bytes on stdout; end of input stops it.
SAMPLER_CHILD = r"""
import ctypes, os, select, sys, time
nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(int(sys.argv[1]), ctypes.byref(handle)) == 0
class Mem(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
mem = Mem()
def used():
    nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem))
    return int(mem.used)
period = float(sys.argv[2])
peak = used()
print(peak, flush=True)
buf = b""
while True:
    u = used()
    peak = max(peak, u)
    if select.select([sys.stdin], [], [], period)[0]:
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            u = used()
            peak = max(peak, u)
            if line == b"reset":
                peak = u
            print(peak if line == b"peak" else u, flush=True)
"""


class PeakSampler:
    """The driver's used memory of a device, sampled every millisecond. With NVML the
    sampling runs in a process of its own, so that it neither waits for this process's
    interpreter lock (and misses short peaks) nor takes it from the steps being timed;
    without NVML, a thread reads cudaMemGetInfo through torch every ~2 ms."""

    def __init__(self, device=0):
        self.device = device
        self.source = "torch.cuda.mem_get_info"
        self._child = None
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", SAMPLER_CHILD, str(device), "0.001"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert int(self._child.stdout.readline()) > 0
            self.source = "nvml (sampled by a separate process)"
            return
        except Exception:
            if self._child is not None:
                self._child.kill()
            self._child = None
        self.peak_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _ask(self, what):
        self._child.stdin.write(what + "\n")
        self._child.stdin.flush()
        return int(self._child.stdout.readline())

    def _read(self):
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _run(self):
        while not self._stop.is_set():
            self.peak_seen = max(self.peak_seen, self._read())
            time.sleep(0.002)

    def pids(self):
        """The sampling process, when there is one."""
        return [self._child.pid] if self._child else []

    def now(self):
        return self._ask("now") if self._child else self._read()

    def peak(self):
        """The highest level sampled since the last reset (the current one included)."""
        if self._child:
            return self._ask("peak")
        return max(self.peak_seen, self._read())

    def reset(self):
        if self._child:
            self._ask("reset")
        else:
            self.peak_seen = self._read()

    def stop(self):
        if self._child:
            self._child.stdin.close()
            self._child.wait(timeout=5)
        else:
            self._stop.set()
            self._thread.join(timeout=2)


def bench_models(device):
    """The head to head's models, in the order they run: name -> (build, step(state, i),
    warm-up steps, timed steps)."""

    def resnet_step_(state, i):
        model, opt = state
        resnet_step(model, opt, device, i, batch=32)

    return {
        "gpt2_generate": (lambda: build_gpt2(device), lambda m, i: run_gpt2(m, device, seed=i), 1, 8),
        "bert_varlen": (lambda: build_bert(device),
                        lambda m, i: run_bert(m, device, BERT_LENGTHS[i % len(BERT_LENGTHS)], batch=8, seed=i),
                        len(BERT_LENGTHS), 4 * len(BERT_LENGTHS)),
        "resnet50_train": (lambda: build_resnet(device), resnet_step_, 3, 30),
        "vit_b_16_infer": (lambda: build_vit(device), lambda m, i: run_vit(m, device, batch=32, seed=i), 3, 30),
    }


def env_list(name):
    """The comma-separated names in environment variable `name` (none when unset)."""
    return [x for x in os.environ.get(name, "").split(",") if x]


def chosen_models(device):
    """`bench_models` limited to the names in PINPOOL_JUDGE_MODELS, when it is set."""
    only = env_list("PINPOOL_JUDGE_MODELS")
    return {k: v for k, v in bench_models(device).items() if not only or k in only}


def empty_device():
    """Drops what Python still holds and empties the allocator's cache."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    time.sleep(0.05)


def worker_bench(mode, rec):
    import torch

    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda:0")
    torch.zeros(1, device=device)  # CUDA (and the allocator) up before the first level
    # ... and its cache emptied: the first tensor's segment (2 MiB for PyTorch's own
    # allocator, a 32 MiB pool chunk for cudaMallocAsync, which gives it back later) must not
    # lower the level peaks count from.
    empty_device()
    sampler = PeakSampler(0)
    rec.put("memory_source", sampler.source)
    # Peaks count from here, the same point in every configuration: what a process holds
    # when a model begins (memory an allocator kept through empty_cache) is device memory
    # it uses too.
    start = sampler.now()
    pin_main_thread(sampler.pids())

    def stats_front():
        """Where this configuration's allocator statistics are read: pinpool's package, or
        torch.cuda (the same function names)."""
        if is_pinpool(mode):
            import pinpool_torch

            return pinpool_torch
        return torch.cuda

    def measure(name, build, step, warmup, steps):
        empty_device()
        try:
            stats_front().reset_peak_memory_stats()
        except Exception:
            pass
        base = sampler.now()
        sampler.reset()
        t0 = time.time()
        try:
            state = build()
            times = []
            counts = None
            for i in range(warmup + steps):
                if i == warmup and is_pinpool(mode):
                    counts = pinpool_counts()
                torch.cuda.synchronize()
                s = time.perf_counter()
                step(state, i)
                torch.cuda.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - s)
            per_step = {}
            if counts is not None:
                after = pinpool_counts()
                per_step = {k: round((after[k] - counts[k]) / max(steps, 1), 2) for k in counts}
            time.sleep(0.01)
            peak = sampler.peak()
            try:
                reserved = stats_front().max_memory_reserved()
            except Exception:
                reserved = None
            try:
                live = stats_front().max_memory_allocated()
            except Exception:
                live = None
            rec.put(
                name,
                {
                    "ok": True,
                    "peak_mib": round((peak - start) / MIB, 1),
                    "held_before_mib": round((base - start) / MIB, 1),
                    "median_ms": round(1000 * statistics.median(times), 3),
                    "times_ms": [round(1000 * t, 3) for t in times],
                    "min_ms": round(1000 * min(times), 3),
                    "steps": len(times),
                    "allocator_peak_reserved_mib": None if reserved is None else round(reserved / MIB, 1),
                    "allocator_peak_allocated_mib": None if live is None else round(live / MIB, 1),
                    **{f"{k}_per_step": v for k, v in per_step.items()},
                    "seconds": round(time.time() - t0, 1),
                },
            )
            del state
        except Exception as e:
            traceback.print_exc()
            rec.put(name, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        print(f"{name}: {time.time() - t0:.1f}s", flush=True)

    for name, (build, step, warmup, steps) in chosen_models(device).items():
        measure(name, build, step, warmup, steps)
    sampler.stop()


def pinpool_counts():
    """pinpool's running counts, from its statistics: driver calls, requests that asked a pool
    actor and their time, alloc and free calls and their time (where the library times them,
    `PINPOOL_TORCH_CALL_TIMES=1`)."""
    import pinpool_torch

    st = pinpool_torch.memory_stats()
    return {
        "driver_calls": st["num_device_alloc"] + st["num_device_free"] + st.get("num_device_remaps", 0),
        # Memory given back to the driver: each waits for the device's queued work.
        "unmaps": st["num_device_free"],
        "misses": st.get("num_misses", 0),
        # Time the requesting threads spent on those requests.
        "miss_ms": st.get("miss_wait_ns", 0) / 1e6,
        # The pool actors' share of it (the rest is hand-offs between threads).
        "served_ms": st.get("miss_serve_ns", 0) / 1e6,
        "allocs": st.get("alloc_calls", 0),
        "alloc_ms": st.get("alloc_call_ns", 0) / 1e6,
        "free_ms": st.get("free_call_ns", 0) / 1e6,
        # CPU time of pinpool's own threads (the actors' workers and their blocking threads):
        # set beside `served_ms`, it tells the actors' work from their waiting.
        "own_cpu_ms": own_threads_cpu() * 1e3,
    }


def voluntary_switches():
    """How often the calling thread has given up its CPU (to wait for a lock, a reply, the
    device), from /proc; 0 where /proc does not tell."""
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def own_threads_cpu():
    """CPU seconds the process's threads named `pinpool*` (the workers of the plug-in's pool
    actors and their runtime's blocking threads) have run, from /proc (schedstat); 0 where
    /proc does not tell."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("pinpool"):
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def worker_lockstep(mode, rec):
    """One configuration of the interleaved timing: runs what the driver says on stdin, one
    command a line (`build MODEL`, `step I`, `drop`, `quit`), and answers each on stdout with
    a line that starts with `@@`. A step's answer is its seconds (the device synchronised
    before and after), then the CPU seconds of the main thread and of the whole process in
    it, how often the main thread gave up its CPU meanwhile, and the CPU seconds of pinpool's
    own threads (see `own_threads_cpu`)."""
    import torch

    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda:0")
    torch.zeros(1, device=device)
    every_cpu = os.sched_getaffinity(0)
    models = bench_models(device)
    state, step = None, None
    print("@@ ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "build":
            # Every worker builds at once: on every CPU, then back to the timing one.
            os.sched_setaffinity(0, every_cpu)
            build, step = models[cmd[1]][0], models[cmd[1]][1]
            state = build()
            torch.cuda.synchronize()
            pin_main_thread()
            print("@@ built", flush=True)
        elif cmd[0] == "step":
            torch.cuda.synchronize()
            switches = voluntary_switches()
            own = own_threads_cpu()
            thread_cpu, process_cpu = time.thread_time(), time.process_time()
            s = time.perf_counter()
            step(state, int(cmd[1]))
            torch.cuda.synchronize()
            took = time.perf_counter() - s
            print(f"@@ {took:.6f} {time.thread_time() - thread_cpu:.6f} "
                  f"{time.process_time() - process_cpu:.6f} {voluntary_switches() - switches}"
                  f" {own_threads_cpu() - own:.6f}",
                  flush=True)
        elif cmd[0] == "drop":
            state = None
            empty_device()
            print("@@ dropped", flush=True)
        elif cmd[0] == "quit":
            break
    rec.put("steps_run", True)


# -- the port of PyTorch's allocator tests (test/test_cuda.py), written for pinpool ------


def cycles_for_ms(ms):
    """GPU cycles for `ms` milliseconds of torch.cuda._sleep (measured once)."""
    import torch

    if not hasattr(cycles_for_ms, "per_ms"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        cycles_for_ms.per_ms = 1_000_000 / max(start.elapsed_time(end), 1e-3)
    return int(ms * cycles_for_ms.per_ms)


def pinpool_tests():
    """Cases run with pinpool as the process's allocator."""
    import pickle
    import tempfile

    import pinpool_torch
    import torch

    def t_alloc_free_roundtrip():
        before = pinpool_torch.memory_allocated()
        x = torch.empty(1 << 20, device="cuda")
        assert pinpool_torch.memory_allocated() - before >= 4 * MIB, "allocation not counted"
        del x
        assert pinpool_torch.memory_allocated() == before, "free not counted"

    def t_zero_size_tensor():
        failures = pinpool_torch.library().pinpool_failures()
        x = torch.empty(0, device="cuda")
        assert x.sum().item() == 0
        del x
        assert pinpool_torch.library().pinpool_failures() == failures, pinpool_torch.last_error()

    def t_torch_memory_calls_give_pinpools_figures():
        # PyTorch's own calls, answered by the shim's allocator front.
        x = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")
        torch_stats = torch.cuda.memory_stats()
        ours = pinpool_torch.memory_stats()
        for key in ("allocated_bytes.all.current", "reserved_bytes.all.current", "segment.all.current",
                    "allocation.all.current", "num_ooms", "num_alloc_retries"):
            assert torch_stats[key] == ours[key], (key, torch_stats[key], ours[key])
        assert torch.cuda.memory_allocated() == ours["allocated_bytes.all.current"]
        assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated() >= 5 * MIB
        peak = torch.cuda.max_memory_allocated()
        assert peak >= torch.cuda.memory_allocated(), peak
        del x
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
        torch.cuda.reset_accumulated_memory_stats()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == 0
        summary = torch.cuda.memory_summary()
        assert "Allocated memory" in summary, summary[:200]
        return f"max_memory_allocated {peak}, then {torch.cuda.max_memory_allocated()} after the reset"

    def t_torch_snapshot_and_history_give_pinpools_layout():
        # torch.cuda.memory._snapshot, _record_memory_history and _dump_snapshot, answered by
        # the allocator front (PyTorch 2.11 on).
        torch.cuda.memory._record_memory_history(max_entries=10000)
        x = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
        # A pool may give idle memory back while the snapshot is taken (a trim after a pause):
        # the segments add up to what was reserved just before or just after.
        before = torch.cuda.memory_reserved()
        snap = torch.cuda.memory._snapshot()
        after = torch.cuda.memory_reserved()
        torch.cuda.memory._record_memory_history(enabled=None)
        segments = snap["segments"]
        reserved = sum(s["total_size"] for s in segments)
        assert reserved in (before, after), (reserved, before, after)
        blocks = []
        for s in segments:
            at = s["address"]
            assert sum(b["size"] for b in s["blocks"]) == s["total_size"], s["address"]
            for b in s["blocks"]:
                blocks.append((at, b))
                at += b["size"]
        mine = [b for at, b in blocks if at == x.data_ptr() and b["state"] == "active_allocated"]
        assert mine and mine[0]["requested_size"] == 3 * MIB, mine
        # The call sites PyTorch's context recorder gathered: this function among them.
        here = lambda frames: any(f["name"] == "t_torch_snapshot_and_history_give_pinpools_layout" for f in frames)
        assert here(mine[0]["frames"]), mine[0]["frames"][:4]
        allocated = sum(s["allocated_size"] for s in segments)
        assert allocated == torch.cuda.memory_allocated(), (allocated, torch.cuda.memory_allocated())
        trace = snap["device_traces"][0]
        allocs = [e for e in trace if e["action"] == "alloc" and e["addr"] == x.data_ptr()]
        assert allocs and allocs[-1]["size"] == 3 * MIB, trace[-5:]
        assert here(allocs[-1]["frames"]), allocs[-1]["frames"][:4]
        times = [e["time_us"] for e in trace]
        assert times == sorted(times), "trace times out of order"
        # On the wall clock, as PyTorch's own trace (microseconds since the epoch).
        assert abs(times[-1] - time.time() * 1e6) < 60e6, (times[-1], time.time())
        path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            dumped = pickle.load(f)
        assert dumped["segments"], "no segments in the dump"
        del x
        return f"{len(segments)} segments, {len(trace)} trace entries"

    def t_history_clear_and_skip_actions():
        # _record_memory_history's clear_history and skip_actions (PyTorch 2.11 on).
        mem = torch.cuda.memory

        def trace():
            torch.cuda.synchronize()
            return mem._snapshot()["device_traces"][0]

        mem._record_memory_history(max_entries=1000)
        x = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
        first = x.data_ptr()
        del x
        assert any(e["action"] == "free_requested" and e["addr"] == first for e in trace())
        mem._record_memory_history(max_entries=1000, clear_history=True, skip_actions=["free_requested"])
        try:
            assert not any(e["action"] == "alloc" for e in trace()), "cleared"
            y = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
            second = y.data_ptr()
            del y
            mine = [e["action"] for e in trace() if e["addr"] == second]
            assert "alloc" in mine and "free_requested" not in mine, mine
            # context="all": frees come with their call sites too.
            mem._record_memory_history(context="all", max_entries=1000)
            z = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")
            third = z.data_ptr()
            del z
            frees = [e for e in trace() if e["action"] == "free_requested" and e["addr"] == third]
            names = [f["name"] for f in frees[-1]["frames"]] if frees else []
            assert "t_history_clear_and_skip_actions" in names, names[:6]
        finally:
            mem._record_memory_history(enabled=None)
        return "cleared, free_requested left out, frees' call sites with context='all'"

    def t_record_stream():
        # test_cuda.py: test_record_stream
        t = torch.FloatTensor([1, 2, 3, 4]).pin_memory()
        result = torch.empty(t.size(), device="cuda")
        stream = torch.cuda.Stream()
        ptr = [None]

        def perform_copy():
            with torch.cuda.stream(stream):
                tmp = t.cuda(non_blocking=True)
                ptr[0] = tmp.data_ptr()
            torch.cuda.current_stream().wait_stream(stream)
            tmp.record_stream(torch.cuda.current_stream())
            torch.cuda._sleep(cycles_for_ms(50))  # delay the copy
            result.copy_(tmp)

        perform_copy()
        with torch.cuda.stream(stream):
            tmp2 = torch.empty(t.size(), device="cuda")
            tmp2.zero_()
            assert tmp2.data_ptr() != ptr[0], "allocation re-used too soon"
        assert result.tolist() == [1, 2, 3, 4]
        # Once the delayed work is done, the block is the stream's again.
        torch.cuda.current_stream().synchronize()
        with torch.cuda.stream(stream):
            tmp3 = torch.empty(t.size(), device="cuda")
        reused = tmp3.data_ptr() == ptr[0]
        return f"block reused after the synchronize: {reused}"

    def t_record_stream_on_shifted_view():
        # test_cuda.py: test_record_stream_on_shifted_view
        stream_alloc = torch.cuda.Stream()
        with torch.cuda.stream(stream_alloc):
            base = torch.empty(10, 10, device="cuda")
        view = base[5:]
        assert view.storage_offset() > 0
        stream_record = torch.cuda.Stream()
        with torch.cuda.stream(stream_record):
            torch.cuda._sleep(cycles_for_ms(50))
        view.record_stream(stream_record)
        data_ptr = base.data_ptr()
        del base, view
        with torch.cuda.stream(stream_alloc):
            try_realloc = torch.empty(10, 10, device="cuda")
        assert try_realloc.data_ptr() != data_ptr, "reused before the recorded stream's work"

    def t_side_stream_blocks_stay_with_their_stream():
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            a = torch.empty(1 << 18, device="cuda")
        p = a.data_ptr()
        del a
        b = torch.empty(1 << 18, device="cuda")  # the default stream
        assert b.data_ptr() != p, "a side stream's free block went to another stream"
        with torch.cuda.stream(s):
            c = torch.empty(1 << 18, device="cuda")
        return f"reused on its own stream: {c.data_ptr() == p}"

    def t_graph_capture_simple():
        # test_cuda.py: test_graph_capture_simple
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            a = torch.full((1000,), 1, device="cuda")
            g = torch.cuda.CUDAGraph()
            torch.cuda.empty_cache()
            g.capture_begin()
            b = a
            for _ in range(10):
                b = b + 1
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        assert b.sum().item() == 11000.0

    def t_graph_two_successive_shared_pool():
        # test_cuda.py: test_graph_two_successive (pool shared through g0.pool())
        s = torch.cuda.Stream()
        a = torch.ones((1 << 20,), device="cuda")

        def func_with_temps(t, val):
            x = t.clone() + val
            y = t.clone() + val
            return x + y

        with torch.cuda.stream(s):
            g0 = torch.cuda.CUDAGraph()
            g1 = torch.cuda.CUDAGraph()
            g0.capture_begin()
            b = a.clone()
            for _ in range(5):
                b = func_with_temps(b, 1)
            g0.capture_end()
            g1.capture_begin(pool=g0.pool())
            for _ in range(5):
                b = func_with_temps(b, 1)
            g1.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        g0.replay()
        g1.replay()
        torch.cuda.synchronize()
        # Each func_with_temps maps v to 2v + 2: ten of them from 1.
        v = 1.0
        for _ in range(10):
            v = 2 * v + 2
        assert bool((b == v).all()), f"expected every element {v}, got {b[:4].tolist()}"
        del g0, g1

    def t_graph_memory_is_not_lent_to_eager_code():
        x = torch.randn(256, 256, device="cuda")
        w = torch.randn(256, 256, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            for _ in range(2):
                (x @ w).relu() @ w
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = ((x @ w).relu() @ w).sin()  # temporaries freed during capture
        expected = ((x @ w).relu() @ w).sin()
        eager = [torch.full((256, 256), 7.0, device="cuda") for _ in range(64)]
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, expected), "graph output changed"
        assert all(bool((e == 7.0).all()) for e in eager), "a replay wrote eager memory"
        del g

    def t_graph_replay_after_empty_cache_and_release():
        before = pinpool_torch.memory_reserved()
        a = torch.randn(1 << 20, device="cuda")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g.capture_begin()
            b = (a * 2).exp() + 1
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.empty_cache()
        g.replay()
        torch.cuda.synchronize()
        assert torch.allclose(b, (a * 2).exp() + 1)
        del b, g
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        after = pinpool_torch.memory_reserved()
        return f"reserved before {before / MIB:.1f} MiB, after release+empty_cache {after / MIB:.1f} MiB"

    def t_graph_pool_handle():
        pool = torch.cuda.graph_pool_handle()
        x = torch.ones(1024, device="cuda")
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, pool=pool):
            y1 = x * 3
        with torch.cuda.graph(g2, pool=pool):
            y2 = y1 + 1
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        assert y2.sum().item() == 4 * 1024
        del g1, g2

    def t_second_capture_into_a_capturing_pool_raises():
        # PyTorch's allocator refuses a capture into a pool that is capturing already
        # ("already recording to mempool_id"); the shim raises pinpool's refusal the same way,
        # before the second capture begins, and the first capture is unaffected.
        pool = torch.cuda.graph_pool_handle()
        x = torch.ones(1024, device="cuda")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        s1.wait_stream(torch.cuda.current_stream())
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        raised = None
        with torch.cuda.stream(s1):
            g1.capture_begin(pool=pool)
            y = x * 2
            with torch.cuda.stream(s2):
                try:
                    g2.capture_begin(pool=pool)
                except RuntimeError as e:
                    raised = e
                else:
                    g2.capture_end()
            g1.capture_end()
        torch.cuda.current_stream().wait_stream(s1)
        assert raised is not None, "a second capture into a capturing pool went on"
        g1.replay()
        torch.cuda.synchronize()
        assert y.sum().item() == 2 * 1024
        del g1, g2
        return f"raised: {str(raised).splitlines()[0][:160]}"

    def t_out_of_memory_during_capture_raises_and_the_graph_replays():
        # Memory cached by another stream, then a request during a capture that only fits if
        # that cache is given back: PyTorch frees no cached block while a capture is underway
        # (a device-wide sync would invalidate the capture). The request raises, the capture
        # ends valid and its graph replays correctly.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            cached = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda")
        del cached  # cached in the side stream's pool
        torch.cuda.synchronize()
        if pinpool_torch.memory_reserved() < int(free * 0.6):
            return "skipped: the side stream's memory went back before the capture"
        x = torch.ones(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        raised = None
        with torch.cuda.stream(s):
            g.capture_begin()
            y = x * 3
            try:
                big = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda")
                del big
            except Exception as e:  # torch.OutOfMemoryError
                raised = e
            z = y + 1
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert raised is not None, "the request fitted: the cache was given back during the capture"
        assert z.sum().item() == 4 * (1 << 20), "the graph replayed wrong"
        del g, y, z
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return f"raised {type(raised).__name__}"

    def t_empty_cache_calls_pinpool():
        x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        del x
        held = pinpool_torch.memory_reserved()
        torch.cuda.empty_cache()
        after = pinpool_torch.memory_reserved()
        assert after < held, f"torch.cuda.empty_cache() kept {after} of {held} bytes"

    def t_reset_peak_memory_stats():
        # Relative to what is allocated already: earlier tests' graphs keep their private
        # pools' memory allocated in this process.
        base = pinpool_torch.memory_allocated()
        x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        del x
        peak = pinpool_torch.max_memory_allocated()
        assert peak >= base + 64 * MIB, (peak, base)
        pinpool_torch.reset_peak_memory_stats()
        now, after = pinpool_torch.memory_allocated(), pinpool_torch.max_memory_allocated()
        assert after < base + 64 * MIB, (after, now, base)
        return f"allocated before {base}, peak {peak}, peak after the reset {after}, allocated now {now}"

    def t_memory_snapshot():
        pinpool_torch.record_memory_history(True)
        x = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
        path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
        pinpool_torch.dump_snapshot(path)
        pinpool_torch.record_memory_history(False)
        with open(path, "rb") as f:
            snap = pickle.load(f)
        assert snap["segments"], "no segments"
        assert any(b["state"] == "active_allocated" for s in snap["segments"] for b in s["blocks"])
        assert "device_traces" in snap
        del x

    def t_threads_allocate_on_their_streams():
        errors = []

        def work(seed):
            try:
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    g = cpu_gen(seed)
                    for _ in range(50):
                        a = torch.randn(1000, generator=g).cuda()
                        b = (a * 2).sum()
                        assert abs(b.item() - 2 * a.sum().item()) < 1e-2
            except Exception as e:
                errors.append(repr(e))

        ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors[:3]

    def t_two_devices():
        if torch.cuda.device_count() < 2:
            return "skipped: one GPU"
        a = torch.randn(1 << 20, device="cuda:0")
        b = a.to("cuda:1")
        c = (b * 2).to("cuda:0")
        assert torch.equal(c, a * 2)
        assert pinpool_torch.memory_allocated(1) >= 4 * MIB

    def t_cudnn_benchmark_conv():
        # cuDNN's autotuner asks the allocator for the largest block it could serve
        # (cacheInfo), which the shim's allocator front answers; the tuned convolution gives
        # the untuned one's results.
        conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
        x = torch.randn(16, 64, 56, 56, device="cuda")
        torch.backends.cudnn.benchmark = False
        plain = conv(x)
        torch.backends.cudnn.benchmark = True
        try:
            tuned = conv(x)
            x.requires_grad_(True)
            conv(x).sum().backward()
            torch.cuda.synchronize()
        finally:
            torch.backends.cudnn.benchmark = False
        assert torch.allclose(plain, tuned, atol=2e-2, rtol=1e-2), (plain - tuned).abs().max().item()

    return [(name[2:], fn) for name, fn in locals().items() if name.startswith("t_")]


def mempool_tests(lib):
    """Cases where PyTorch's own allocator stays, and one MemPool takes its segments from
    pinpool (test_cuda.py's TestMemPool, with pinpool in place of the dummy allocator)."""
    import pinpool_torch
    import torch

    plug = pinpool_torch.pluggable_allocator(lib)

    def t_mempool_with_allocator():
        pool = torch.cuda.MemPool(plug.allocator())
        before = pinpool_torch.memory_stats(0)["allocation.all.current"]
        with torch.cuda.use_mem_pool(pool):
            out = torch.randn(1, device="cuda")
        during = pinpool_torch.memory_stats(0)["allocation.all.current"]
        assert during > before, "the pool's segment did not come from pinpool"
        assert out.sum().item() == out.item()
        outside = torch.randn(1, device="cuda")  # PyTorch's own pool
        del out, outside
        return f"pinpool blocks: {before} -> {during}"

    def t_mempool_segments_go_back_on_empty_cache():
        pool = torch.cuda.MemPool(plug.allocator())
        with torch.cuda.use_mem_pool(pool):
            x = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        held = pinpool_torch.memory_stats(0)["allocation.all.current"]
        del x
        del pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        now = pinpool_torch.memory_stats(0)["allocation.all.current"]
        return f"pinpool blocks: {held} -> {now} after the pool was dropped and emptied"

    def t_mempool_snapshot_lists_the_segment():
        pool = torch.cuda.MemPool(plug.allocator())
        with torch.cuda.use_mem_pool(pool):
            x = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
        snap = pool.snapshot()
        assert len(snap) >= 1, "no segment in the pool's snapshot"
        del x

    def t_mempool_context_nesting():
        pool1 = torch.cuda.MemPool(plug.allocator())
        pool2 = torch.cuda.MemPool(plug.allocator())
        with torch.cuda.use_mem_pool(pool1):
            a = torch.empty(1024, device="cuda")
            with torch.cuda.use_mem_pool(pool2):
                b = torch.empty(1024, device="cuda")
            c = torch.empty(1024, device="cuda")
        assert len(pool1.snapshot()) >= 1 and len(pool2.snapshot()) >= 1
        del a, b, c

    return [(name[2:], fn) for name, fn in locals().items() if name.startswith("t_")]


def oom_tests():
    """Out of memory and the memory fraction, last: a NULL that PyTorch does not check would
    end the process."""
    import pinpool_torch
    import torch

    total = torch.cuda.get_device_properties(0).total_memory

    def t_out_of_memory_raises():
        try:
            x = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        except Exception as e:  # torch.OutOfMemoryError, or RuntimeError
            return f"raised {type(e).__name__}: {str(e)[:200]}"
        ptr = x.data_ptr()
        raise AssertionError(f"no error; data_ptr {ptr:#x}")

    def t_memory_fraction_caps_pinpool():
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
        try:
            try:
                x = torch.empty(int(0.5 * total), dtype=torch.uint8, device="cuda")
                raise AssertionError(f"half the device allocated under a 0.25 cap (ptr {x.data_ptr():#x})")
            except AssertionError:
                raise
            except Exception as e:
                msg = f"over the cap: {type(e).__name__}"
            y = torch.empty(int(0.1 * total), dtype=torch.uint8, device="cuda")
            del y
            return msg
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)

    def t_allocation_works_after_oom():
        x = torch.ones(1 << 20, device="cuda")
        assert x.sum().item() == 1 << 20
        return f"num_ooms: {pinpool_torch.memory_stats().get('num_ooms')}"

    return [(name[2:], fn) for name, fn in locals().items() if name.startswith("t_")]


def run_cases(cases, rec):
    import torch

    for name, fn in cases:
        t0 = time.time()
        try:
            note = fn()
            torch.cuda.synchronize()
            rec.put(name, {"ok": True, "note": note})
            print(f"PASS {name} {note or ''}", flush=True)
        except Exception as e:
            traceback.print_exc()
            rec.put(name, {"ok": False, "error": f"{type(e).__name__}: {e}"})
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        print(f"  {name}: {time.time() - t0:.2f}s", flush=True)


def worker_info(mode, rec):
    import torch

    rec.put("torch", torch.__version__)
    rec.put("cuda", torch.version.cuda)
    rec.put("devices", torch.cuda.device_count())
    rec.put("gpu", torch.cuda.get_device_name(0))
    rec.put("total_mib", torch.cuda.get_device_properties(0).total_memory // MIB)
    for pkg in ("torchvision", "transformers"):
        try:
            rec.put(pkg, __import__(pkg).__version__)
        except Exception as e:
            rec.put(pkg, f"unavailable: {e}")
    if mode == "pinpool":
        import pinpool_torch

        x = torch.ones(10, device="cuda")
        rec.put("pinpool_sum", x.sum().item())
        rec.put("pinpool_stats_keys", len(pinpool_torch.memory_stats()))
        rec.put("graph_hooks", pinpool_torch.graph_hooks())
        rec.put("shim", pinpool_torch.shim())


def cpu_loop_ms():
    """The time of a fixed pure-Python loop on the calling thread, in ms."""
    t = time.perf_counter()
    x = 0
    for i in range(200_000):
        x += i
    return (time.perf_counter() - t) * 1e3


def cpu_speeds(cpus, reps=5):
    """Each CPU's time for `cpu_loop_ms` (the best of `reps`), measured by moving the calling
    thread onto that CPU alone; its affinity is restored after."""
    before = os.sched_getaffinity(0)
    speeds = {}
    try:
        for c in sorted(cpus):
            os.sched_setaffinity(0, {c})
            speeds[c] = min(cpu_loop_ms() for _ in range(reps))
    finally:
        os.sched_setaffinity(0, before)
    return speeds


def timing_cpu():
    """The CPU that every timing worker's (bench, lockstep) main thread is pinned to, or None;
    and why.

    The virtual machines this runs on have CPUs of unequal and changing speed: a pure-Python
    loop takes up to 1.8 times as long on some as on others, which ones changes within
    minutes, and a process's main thread stays on the CPU it started on. Step times then
    compare CPUs, not allocators. One CPU for the main threads of all configurations makes
    them meet the same CPU; in the interleaved run, at nearly the same time too.
    PINPOOL_JUDGE_CPU: "auto" (the default) is the fastest of a loop timed twice on each CPU
    the driver may use, a number names the CPU, and "none" leaves the threads to the
    scheduler."""
    want = os.environ.get("PINPOOL_JUDGE_CPU", "auto").strip()
    if want == "none":
        return None, "chosen by the scheduler (PINPOOL_JUDGE_CPU=none)"
    allowed = os.sched_getaffinity(0)
    if want != "auto":
        if want.isdigit() and int(want) in allowed:
            return int(want), "from PINPOOL_JUDGE_CPU"
        return None, f"chosen by the scheduler (PINPOOL_JUDGE_CPU={want} is not a CPU here)"
    first, second = cpu_speeds(allowed), cpu_speeds(allowed)
    speeds = {c: min(first[c], second[c]) for c in first}
    table = " ".join(f"{c}:{speeds[c]:.1f}" for c in sorted(speeds))
    return min(speeds, key=speeds.get), f"the fastest of a loop timed on each CPU (ms: {table})"


def pin_main_thread(others=()):
    """Moves the calling (main) thread onto the CPU the driver chose (PINPOOL_JUDGE_WORKER_CPU),
    and every other thread of this process (the allocator's, CUDA's), with the processes
    `others` (the memory sampler), off it, so that the timed thread has that CPU to itself.
    Threads the main thread starts later (autograd's) share its CPU."""
    cpu = os.environ.get("PINPOOL_JUDGE_WORKER_CPU")
    if not cpu:
        return
    cpu = int(cpu)
    rest = os.sched_getaffinity(0) - {cpu}
    me = threading.get_native_id()
    for tid in [int(t) for t in os.listdir("/proc/self/task")] + list(others):
        if tid != me and rest:
            try:
                os.sched_setaffinity(tid, rest)
            except OSError:
                pass  # gone meanwhile, or another's CPUs it may not change
    os.sched_setaffinity(0, {cpu})


def worker(part, mode, lib, out):
    for k, v in MODES[mode].items():
        os.environ[k] = v
    rec = Recorder(os.path.join(out, f"{part}-{mode}.json"))
    try:
        rec.put("setup", setup_mode(mode if part != "mempool" else "native", lib))
    except Exception as e:
        traceback.print_exc()
        rec.put("setup_error", f"{type(e).__name__}: {e}")
        return 3
    if part == "info":
        worker_info(mode, rec)
    elif part == "results":
        worker_results(mode, rec)
    elif part == "threads":
        worker_threads(mode, rec)
    elif part == "bench":
        worker_bench(mode, rec)
    elif part == "lockstep":
        worker_lockstep(mode, rec)
    elif part == "tests":
        run_cases(pinpool_tests(), rec)
    elif part == "mempool":
        run_cases(mempool_tests(lib), rec)
    elif part == "oom":
        run_cases(oom_tests(), rec)
    else:
        raise SystemExit(f"unknown part {part}")
    rec.put("done", True)
    return 0


# ---------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------


class Stepper:
    """A lockstep worker: commands go to its stdin; its answers are the stdout lines that
    start with `@@`, read on a thread, so that a worker that hangs costs a timeout and not the
    run. Everything else it writes goes to its log."""

    def __init__(self, judge, mode, out, rank=None):
        """A worker of configuration `mode`; with a `rank`, one of several, writing into the
        folder `p<rank>` of `out`."""
        self.mode = mode if rank is None else f"{mode}.{rank}"
        if rank is not None:
            out = os.path.join(out, f"p{rank}")
            os.makedirs(out, exist_ok=True)
        self.logf = open(os.path.join(out, f"lockstep-{mode}.log"), "w")
        self.p = subprocess.Popen(judge.worker_cmd("lockstep", mode, out), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.logf, text=True,
                                  env=judge.worker_env("lockstep"))
        self.answers = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("@@ "):
                self.answers.put(line[3:].strip())
            else:
                self.logf.write(line)
                self.logf.flush()
        self.answers.put(None)

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def answer(self, timeout):
        try:
            got = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.mode}: no answer in {timeout:.0f}s") from None
        if got is None:
            raise RuntimeError(f"{self.mode}: the worker ended (exit {self.p.wait()})")
        return got

    def close(self):
        try:
            self.send("quit")
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        # The reader ends at the end of the worker's output, then its pipe can close.
        self.reader.join(timeout=5)
        if not self.reader.is_alive():
            self.p.stdout.close()
        self.logf.close()


class Judge:
    def __init__(self, lib, out, budget):
        self.lib = os.path.abspath(lib)
        self.out = os.path.abspath(out)
        self.deadline = time.time() + budget
        self.log_file = open(os.path.join(self.out, "judge.log"), "a")
        self.summary = {"verdicts": {}}
        self.cpu, self.cpu_why = timing_cpu()

    def log(self, text=""):
        print(text, flush=True)
        self.log_file.write(text + "\n")
        self.log_file.flush()

    def left(self):
        return self.deadline - time.time()

    def worker_env(self, part):
        """A worker's environment: the configuration's own settings come from MODES."""
        env = dict(os.environ)
        for k in ("PYTORCH_CUDA_ALLOC_CONF",):
            env.pop(k, None)
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("PYTHONHASHSEED", "0")
        env.pop("PINPOOL_JUDGE_WORKER_CPU", None)
        if part in ("bench", "lockstep") and self.cpu is not None:
            env["PINPOOL_JUDGE_WORKER_CPU"] = str(self.cpu)
        if part == "bench":
            # pinpool's alloc and free calls timed (two clock reads a call): the allocator's
            # share of a step. The interleaved steps, whose times are the verdicts, go without.
            env["PINPOOL_TORCH_CALL_TIMES"] = "1"
        if part == "tests":
            # The ported cases copy tensors between GPUs when there are two: mapped memory
            # reaches another GPU only with peer access granted up front (docs/torch.md).
            env.setdefault("PINPOOL_TORCH_PEER_ACCESS", "1")
        return env

    def worker_cmd(self, part, mode, out):
        return [sys.executable, "-u", os.path.abspath(__file__), "--worker", part, "--mode", mode,
                "--lib", self.lib, "--out", out]

    def run(self, part, mode, timeout, sub=None):
        """Runs one worker, writing into `sub` of the output folder when given; returns its
        JSON (or {} and the reason it has none)."""
        name = f"{part}-{mode}"
        out = os.path.join(self.out, sub) if sub else self.out
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, name + ".json")
        if os.path.exists(path):
            os.unlink(path)
        timeout = int(min(timeout, self.left() - 5))
        if timeout < 10:
            self.log(f"[{name}] skipped: the run's time is spent")
            return {"_skipped": "time"}
        t0 = time.time()
        with open(os.path.join(out, name + ".log"), "w") as logf:
            try:
                p = subprocess.run(self.worker_cmd(part, mode, out), stdout=logf, stderr=subprocess.STDOUT,
                                   env=self.worker_env(part), timeout=timeout)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        took = time.time() - t0
        data = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        status = "ok" if rc == 0 else f"exit {rc}"
        self.log(f"[{sub + '/' if sub else ''}{name}] {status} in {took:.0f}s")
        if rc != 0:
            data["_exit"] = str(rc)
            self.log(f"  last lines of {name}.log:")
            try:
                with open(os.path.join(self.out, name + ".log")) as f:
                    for line in f.readlines()[-15:]:
                        self.log("    " + line.rstrip())
            except OSError:
                pass
        return data

    def verdict(self, key, ok, detail=""):
        self.summary["verdicts"][key] = {"ok": bool(ok), "detail": detail}
        self.log(f"  {'PASS' if ok else 'FAIL'} {key}{': ' + detail if detail else ''}")

    # -- parts ----------------------------------------------------------------------------

    def info(self):
        self.log("== environment")
        try:
            import pinpool_torch

            t0 = time.time()
            _, path, flavour = pinpool_torch._build_shim()
            self.log(f"shim: {flavour} ({path}) in {time.time() - t0:.1f}s "
                     f"{pinpool_torch.shim().get('fallback_reason', '')}")
        except Exception as e:
            self.log(f"shim: not built: {e}")
        native = self.run("info", "native", 60)
        pin = self.run("info", "pinpool", 60)
        for k in ("torch", "cuda", "gpu", "devices", "total_mib", "torchvision", "transformers"):
            self.log(f"  {k}: {native.get(k)}")
        self.log(f"  pinpool: sum {pin.get('pinpool_sum')}, graph hooks {pin.get('graph_hooks')}, "
                 f"shim {pin.get('shim')}, setup {pin.get('setup', pin.get('setup_error'))}")
        self.summary["info"] = {"native": native, "pinpool": pin}
        self.verdict("pinpool allocates for torch", pin.get("pinpool_sum") == 10.0,
                     str(pin.get("setup_error", "")))
        return native

    def results(self):
        self.log("== same results (deterministic; native vs pinpool, bit for bit)")
        native = self.run("results", "native", 150)
        pin = self.run("results", "pinpool", 150)
        self.summary["results"] = {"native": native, "pinpool": pin}
        differing = []
        for model in ("gpt2", "bert", "resnet50_train", "vit_b_16", "cuda_graph"):
            n, p = native.get(model, {}), pin.get(model, {})
            if not n.get("ok"):
                self.verdict(f"same results: {model}", False, f"native run failed: {n.get('error', 'no result')}")
                continue
            if not p.get("ok"):
                self.verdict(f"same results: {model}", False, f"pinpool run failed: {p.get('error', 'no result')}")
                continue
            diff = [k for k in n["hashes"] if n["hashes"][k] != p["hashes"].get(k)]
            if diff:
                differing.append(model)
            self.verdict(f"same results: {model}", not diff,
                         f"{len(n['hashes'])} outputs identical" if not diff else f"differ: {diff}")
        if differing and self.left() > 200:
            self.log("  control: a second native run, to tell whether those outputs are deterministic at all")
            again = self.run("results", "native-again", 150)
            self.summary["results"]["native_again"] = again
            for model in differing:
                n, a = native.get(model, {}), again.get(model, {})
                same = a.get("ok") and a["hashes"] == n["hashes"]
                self.log(f"  control {model}: native twice {'identical' if same else 'DIFFERS (not deterministic under native either)'}")
                mn = native.get("magnitudes", {}).get(model)
                mp = pin.get("magnitudes", {}).get(model)
                ma = again.get("magnitudes", {}).get(model)
                if mn and mp:
                    rel = lambda x: abs(x - mn) / max(abs(mn), 1e-30)
                    self.log(f"    sum|x| relative difference: pinpool vs native {rel(mp):.3e}"
                             + (f", native vs native {rel(ma):.3e}" if ma else ""))

    def tests(self):
        self.log("== PyTorch's allocator tests, ported (pinpool as the allocator)")
        total = {"pass": 0, "fail": 0}
        for part, mode, timeout in (("tests", "pinpool", 120), ("mempool", "pinpool", 90), ("oom", "pinpool", 60)):
            data = self.run(part, mode, timeout)
            self.summary[part] = data
            for name, r in data.items():
                if not isinstance(r, dict) or "ok" not in r:
                    continue
                total["pass" if r["ok"] else "fail"] += 1
                self.log(f"  {'PASS' if r['ok'] else 'FAIL'} {part}/{name}"
                         f"{': ' + str(r.get('note')) if r['ok'] and r.get('note') else ''}"
                         f"{': ' + r.get('error', '') if not r['ok'] else ''}")
            if data.get("_exit") and not data.get("done"):
                self.log(f"  {part}: the process ended early ({data.get('_exit')}): the cases after the last one listed did not run")
                total["fail"] += 1
        self.log(f"  {total['pass']} passed, {total['fail']} failed")
        self.summary["tests_total"] = total
        self.verdict("ported tests", total["fail"] == 0 and total["pass"] > 0, f"{total['pass']} passed, {total['fail']} failed")

    def threads(self):
        self.log("== two threads on two streams at once (two GPUs when present)")
        native = self.run("threads", "native", 100)
        pin = self.run("threads", "pinpool", 100)
        self.summary["threads"] = {"native": native, "pinpool": pin}
        n, p = native.get("hashes"), pin.get("hashes")
        ok = bool(n) and n == p and not pin.get("errors") and not native.get("errors")
        self.verdict("two threads, two streams: same results", ok,
                     f"devices {pin.get('devices')}; native {n} pinpool {p}; errors {native.get('errors')} {pin.get('errors')}")

    def bench(self):
        self.log("== head to head: peak device memory (driver's used memory, sampled); the step times here are each worker's own, the time verdicts come from the interleaved run below")
        modes = COMPARED
        rounds = max(1, int(os.environ.get("PINPOOL_JUDGE_ROUNDS", "1")))
        per_round = []
        for r in range(rounds):
            # Every other round in the opposite order, so that a drift of the host's speed
            # during the run weighs on every configuration alike.
            order = modes if r % 2 == 0 else tuple(reversed(modes))
            got = {m: self.run("bench", m, 150, sub=f"round-{r + 1}") for m in order}
            per_round.append(got)
        self.summary["bench_rounds"] = per_round
        models = tuple(chosen_models("cuda:0"))
        runs = {m: combine_rounds([pr[m] for pr in per_round], models) for m in modes}
        self.summary["bench"] = runs
        self.log(f"  {rounds} round(s), each configuration in a fresh process per round; per model:"
                 " the median of the rounds' peaks, and the median of all their step times")
        self.log(f"  memory source: {runs['native'].get('memory_source')}")
        header = f"  {'model':<16} {'config':<11} {'peak MiB':>9} {'vs best':>8} {'median ms':>10} {'vs best':>8}"
        self.log(header)
        for model in models:
            rows = {m: runs[m].get(model, {}) for m in runs}
            ok_rows = {m: r for m, r in rows.items() if r.get("ok")}
            torch_ok = [ok_rows[m] for m in TORCH_MODES if m in ok_rows]
            best_mem = min((r["peak_mib"] for r in torch_ok), default=None)
            best_time = min((r["median_ms"] for r in torch_ok), default=None)
            for m in modes:
                r = rows.get(m, {})
                if not r.get("ok"):
                    self.log(f"  {model:<16} {m:<11} {'-':>9} {'':>8} {'-':>10} {'':>8}  {r.get('error', 'no result')}")
                    continue
                mr = f"{r['peak_mib'] / best_mem:.2f}x" if best_mem else "-"
                tr = f"{r['median_ms'] / best_time:.2f}x" if best_time else "-"
                self.log(f"  {model:<16} {m:<11} {r['peak_mib']:>9.1f} {mr:>8} {r['median_ms']:>10.2f} {tr:>8}"
                         f"  (held before {r.get('held_before_mib')} MiB;"
                         f" allocator's peaks: reserved {r.get('allocator_peak_reserved_mib')} MiB,"
                         f" allocated {r.get('allocator_peak_allocated_mib')} MiB; rounds' medians"
                         f" {r.get('round_medians_ms')} ms"
                         + (f"; per step {r['driver_calls_per_step']} driver calls,"
                            f" {r.get('unmaps_per_step')} unmaps, {r.get('misses_per_step')} misses"
                            f" taking {r.get('miss_ms_per_step')} ms (serving them"
                            f" {r.get('served_ms_per_step')} ms; pinpool's threads ran {r.get('own_cpu_ms_per_step')} ms);"
                            f" {r.get('allocs_per_step')} allocs"
                            f" taking {r.get('alloc_ms_per_step')} ms, their frees {r.get('free_ms_per_step')} ms"
                            if r.get("driver_calls_per_step") is not None else "")
                         + ")")
            p = ok_rows.get("pinpool")
            if p and best_mem is not None:
                self.verdict(f"memory {model}", p["peak_mib"] <= best_mem,
                             f"pinpool {p['peak_mib']:.1f} MiB, best of PyTorch's {best_mem:.1f} MiB")
            else:
                self.verdict(f"memory {model}", False, "no pinpool or PyTorch result")

    def lockstep(self):
        """Step times with every compared configuration side by side: PINPOOL_JUDGE_PROCS worker
        processes per configuration (default 2), all alive at once, taking turns of
        PINPOOL_JUDGE_TURN steps (default 3), the order of the configurations rotating every
        turn, so that the host's speed, which drifts by up to 2x within minutes on the GPU
        machines, weighs on every configuration alike. Only one worker has work on the GPU at
        a time. Each process runs a model's warm-up steps, untimed; the timed steps are split
        between a configuration's processes turn by turn, every configuration timing each
        step once, on its process of the same rank: a process keeps a speed of its own for its
        life (where the loader put its code and data, which CPU it met), and a configuration's
        figure is then not one process's luck. Most timed steps follow the same process's own
        step, as in a process that runs alone; the first step of each turn follows another
        process's and is shown apart too (its threads may have slept and its caches gone
        cold)."""
        turn = max(1, int(os.environ.get("PINPOOL_JUDGE_TURN", "3")))
        procs = max(1, int(os.environ.get("PINPOOL_JUDGE_PROCS", "2")))
        self.log(f"== step time, interleaved: {procs} process(es) per configuration, "
                 f"{turn} step(s) each in turn")
        modes = COMPARED
        out = os.path.join(self.out, "lockstep")
        os.makedirs(out, exist_ok=True)
        table = chosen_models("cuda:0")
        # times[m][name][j]: configuration m's time of timed step j, which its process of rank
        # rank(j) ran.
        times = {m: {} for m in modes}
        # hosts[m][name][j]: the main thread's and the process's CPU seconds in that step, the
        # main thread's voluntary context switches, and pinpool's own threads' CPU seconds.
        hosts = {m: {} for m in modes}
        workers = {}

        def rank(j):
            return (j // turn) % procs

        def wait(w):
            return workers[w].answer(max(5, min(150, self.left() - 5)))

        try:
            for r in range(procs):
                for m in modes:
                    workers[(m, r)] = Stepper(self, m, out, r if procs > 1 else None)
            for w in workers:
                wait(w)
            for name, (_, _, warmup, steps) in table.items():
                for w in workers:
                    workers[w].send(f"build {name}")
                for w in workers:
                    wait(w)
                for w in workers:
                    for i in range(warmup):
                        workers[w].send(f"step {i}")
                        wait(w)
                for n, start in enumerate(range(0, steps, turn)):
                    k = (n // procs) % len(modes)
                    for m in modes[k:] + modes[:k]:
                        for j in range(start, min(start + turn, steps)):
                            w = (m, rank(j))
                            workers[w].send(f"step {warmup + j}")
                            took, *host = (float(x) for x in wait(w).split())
                            times[m].setdefault(name, []).append(1000 * took)
                            hosts[m].setdefault(name, []).append(host)
                for w in workers:
                    workers[w].send("drop")
                for w in workers:
                    wait(w)
        except Exception as e:
            self.log(f"  stopped: {type(e).__name__}: {e} (see the logs in {out})")
        finally:
            for w in workers.values():
                w.close()
        ranks = {m: {name: [rank(j) for j in range(len(t))] for name, t in times[m].items()}
                 for m in modes}
        self.summary["lockstep"] = {"turn": turn, "procs": procs, "times_ms": times, "ranks": ranks,
                                    "host": hosts}

        def medians(groups):
            return " / ".join(f"{statistics.median(x):.2f}" if x else "-" for x in groups)

        self.log(f"  {'model':<16} {'config':<11} {'median ms':>10} {'vs best':>8}"
                 f"  (medians of the first steps of turns / of the others; of each process)")
        for name, (_, _, warmup, steps) in table.items():
            got = {m: times[m].get(name) for m in modes}
            if any(not t or len(t) < steps for t in got.values()):
                self.verdict(f"time {name}", False, "not every configuration ran every step")
                continue
            med = {m: statistics.median(t) for m, t in got.items()}
            fastest = min(TORCH_MODES, key=lambda m: med[m])
            best = med[fastest]
            # Turns start at multiples of `turn`: timed step j is the first of its turn when
            # j % turn == 0.
            first = [j % turn == 0 for j in range(steps)]
            for m in modes:
                rest = [t for t, f in zip(got[m], first) if not f]
                firsts = [t for t, f in zip(got[m], first) if f]
                each = [[t for j, t in enumerate(got[m]) if rank(j) == r] for r in range(procs)]
                split = f"  ({medians((firsts, rest))}; {medians(each)})"
                self.log(f"  {name:<16} {m:<11} {med[m]:>10.2f} {med[m] / best:>7.2f}x{split}")
            # Step by step against the fastest configuration's step next to it (not against
            # the least of three at each step, which noise alone would put below each one).
            paired = statistics.median(p / f for p, f in zip(got["pinpool"], got[fastest]))
            self.verdict(f"time {name}", med["pinpool"] <= 1.05 * best,
                         f"pinpool {med['pinpool']:.2f} ms, fastest of PyTorch's ({fastest})"
                         f" {best:.2f} ms (target <= 1.05x); step by step, the median of pinpool's"
                         f" step over {fastest}'s next to it: {paired:.2f}x")
        self.log("  where a step's time goes, medians per step: CPU ms of the main thread / of the"
                 " whole process (every thread), the main thread's voluntary context switches,"
                 " and (pinpool) the CPU ms of its own threads")
        for name in table:
            for m in modes:
                host = hosts[m].get(name)
                if host:
                    main, whole, switches = (statistics.median(h[k] for h in host) for k in range(3))
                    own = ""
                    if is_pinpool(m) and all(len(h) > 3 for h in host):
                        own = f"  {1000 * statistics.median(h[3] for h in host):>8.2f} ms pinpool's threads"
                    self.log(f"  {name:<16} {m:<11} {1000 * main:>8.2f} / {1000 * whole:>8.2f} ms"
                             f"  {switches:>7.0f} switches{own}")

    def main(self):
        t0 = time.time()
        self.log(f"torch-judge: {time.strftime('%Y-%m-%d %H:%M:%S')} lib={self.lib} out={self.out}")
        if not os.path.isfile(self.lib):
            self.log(f"no library at {self.lib}")
            return 2
        self.log(f"timing workers' main threads (bench, lockstep) on CPU "
                 f"{'' if self.cpu is None else self.cpu}: {self.cpu_why}")
        self.summary["timing_cpu"] = {"cpu": self.cpu, "why": self.cpu_why}
        for name, conf in VARIANTS.items():
            self.log(f"{name}: pinpool with PINPOOL_DEVICE_CONF={conf}")
        self.summary["variants"] = VARIANTS
        parts = env_list("PINPOOL_JUDGE_PARTS")
        for step in (self.info, self.results, self.tests, self.bench, self.lockstep, self.threads):
            if parts and step.__name__ not in parts:
                continue
            try:
                step()
            except Exception as e:
                self.log(f"{step.__name__} failed in the driver: {type(e).__name__}: {e}")
                self.log(traceback.format_exc())
        v = self.summary["verdicts"]
        passed = sum(1 for x in v.values() if x["ok"])
        self.log(f"== {passed} passed, {len(v) - passed} failed (verdicts); {time.time() - t0:.0f}s in all")
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=1, sort_keys=True, default=str)
        return 0 if passed == len(v) else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=465)
    ap.add_argument("--worker")
    ap.add_argument("--mode", default="native")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.worker:
        mode = "native" if a.mode == "native-again" else a.mode
        if a.mode == "native-again":
            # Its own file name, the native configuration.
            MODES["native-again"] = MODES["native"]
            mode = "native-again"
        sys.exit(worker(a.worker, mode, os.path.abspath(a.lib), a.out))
    sys.exit(Judge(a.lib, a.out, a.budget).main())


if __name__ == "__main__":
    main()
