#!/usr/bin/env python3
"""Records allocation request streams of PyTorch workloads, in pinpool's trace format.

    python3 scripts/record-traces.py [--cold] OUT_DIR [NAME ...]

Needs a CUDA GPU and PyTorch (and torchvision for its two models). Each workload is built from
`torch.nn` or torchvision's model definitions (random weights from a fixed seed, no downloads:
it runs offline), run once to warm up, then once more while PyTorch's allocator history records every
request (`torch.cuda.memory._record_memory_history`). The requests of that run become
`OUT_DIR/<name>.trace.gz`. With `--cold` the recording starts before the workload is built, so
the trace also holds its parameters, its warm-up run and everything a first run allocates
(optimizer state, workspaces), and goes to `OUT_DIR/<name>_cold.trace.gz`:

    a <id> <bytes> <stream>    allocation number <id> (dense, in order) of <bytes> on <stream>
    f <id>                     allocation <id> is freed

(the format `pinpool_tools::trace` reads; `replay` and `device_bench` take these files). Frees of
memory allocated before the recorded run are left out; allocations still live at its end have
no `f` line. Streams are numbered in order of first use.
"""

import gzip
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = "cuda"


def vit_infer_b16():
    """A ViT-Base-like encoder (patch embedding, 12 layers, d=768), inference, batch 16."""
    patch = nn.Conv2d(3, 768, 16, 16).to(DEV)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True, norm_first=True),
        12,
        enable_nested_tensor=False,
    ).to(DEV)
    head = nn.Linear(768, 1000).to(DEV)
    cls = torch.zeros(1, 1, 768, device=DEV)

    def run():
        with torch.no_grad():
            x = torch.randn(16, 3, 224, 224, device=DEV)
            t = patch(x).flatten(2).transpose(1, 2)
            t = torch.cat([cls.expand(16, -1, -1), t], 1)
            return head(enc(t)[:, 0]).argmax(-1)

    return run


def cnn_train_b64():
    """A VGG-like CNN with batch norm, one SGD step with momentum, batch 64 at 112x112."""
    layers, c = [], 3
    for width, n in [(64, 2), (128, 2), (256, 3), (512, 3)]:
        for _ in range(n):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            c = width
        layers.append(nn.MaxPool2d(2))
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 100))
    model = model.to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def run():
        x = torch.randn(64, 3, 112, 112, device=DEV)
        y = torch.randint(0, 100, (64,), device=DEV)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return run


def lstm_train_b32_s128():
    """A two-layer LSTM language model (1024 hidden, 8k vocabulary), one Adam step."""
    emb = nn.Embedding(8192, 512).to(DEV)
    lstm = nn.LSTM(512, 1024, 2, batch_first=True).to(DEV)
    out = nn.Linear(1024, 8192).to(DEV)
    params = list(emb.parameters()) + list(lstm.parameters()) + list(out.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)

    def run():
        tok = torch.randint(0, 8192, (32, 129), device=DEV)
        h, _ = lstm(emb(tok[:, :-1]))
        loss = F.cross_entropy(out(h).flatten(0, 1), tok[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return run


def decoder_serving_mix():
    """A GPT-like causal decoder (8 layers, d=1024) serving requests of varied batch and
    prompt length, each followed by a few decoding steps that re-run the grown sequence."""
    d, vocab = 1024, 16384
    emb = nn.Embedding(vocab, d).to(DEV)
    pos = nn.Embedding(2048, d).to(DEV)
    layer = nn.TransformerEncoderLayer(d, 16, 4 * d, batch_first=True, norm_first=True)
    dec = nn.TransformerEncoder(layer, 8, enable_nested_tensor=False).to(DEV)
    head = nn.Linear(d, vocab).to(DEV)
    requests = [(1, 37), (4, 120), (2, 511), (8, 64), (1, 900), (3, 250), (6, 33), (2, 700)]

    def run():
        with torch.no_grad():
            for batch, length in requests:
                tok = torch.randint(0, vocab, (batch, length), device=DEV)
                for _ in range(4):
                    n = tok.shape[1]
                    mask = nn.Transformer.generate_square_subsequent_mask(n, device=DEV)
                    x = emb(tok) + pos(torch.arange(n, device=DEV))
                    nxt = head(dec(x, mask=mask, is_causal=True)[:, -1]).argmax(-1)
                    tok = torch.cat([tok, nxt[:, None]], 1)

    return run


class _Block(nn.Module):
    """A pre-norm GPT-2 block whose attention keeps a key/value cache that grows by one
    position a step (`torch.cat`, as simple generation loops do)."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, cache):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x, (k, v)


def gpt2_decode_kv_small():
    """A GPT-2-like decoder (6 layers, d=1024) generating token by token with a key/value
    cache, for requests of batch 1 to 4: mostly small requests, a small peak."""
    d, vocab, layers = 1024, 16384, 6
    emb = nn.Embedding(vocab, d).to(DEV)
    pos = nn.Embedding(1024, d).to(DEV)
    blocks = nn.ModuleList(_Block(d, 16) for _ in range(layers)).to(DEV)
    ln, head = nn.LayerNorm(d).to(DEV), nn.Linear(d, vocab).to(DEV)
    # (batch, prompt length, new tokens): about 18 000 requests (some 100 a token), and a
    # peak of about 20 MiB (the caches of the batch of 4 at 88 positions).
    requests = [(2, 96, 64), (4, 48, 40), (1, 160, 48), (3, 32, 32)]

    def step(tok, start, caches):
        x = emb(tok) + pos(torch.arange(start, start + tok.shape[1], device=DEV))
        new = []
        for blk, cache in zip(blocks, caches):
            x, c = blk(x, cache)
            new.append(c)
        return head(ln(x[:, -1])).argmax(-1, keepdim=True), new

    def run():
        with torch.no_grad():
            for batch, prompt, steps in requests:
                tok = torch.randint(0, vocab, (batch, prompt), device=DEV)
                nxt, caches = step(tok, 0, [None] * layers)
                for i in range(steps):
                    nxt, caches = step(nxt, prompt + i, caches)
                del caches, nxt

    return run


def resnet50_train_b32_x3():
    """torchvision's ResNet-50, three SGD steps with momentum, batch 32 at 224x224 (the torch judge's training model)."""
    from torch_judge import build_resnet, resnet_step

    torch.backends.cudnn.benchmark = False
    model, opt = build_resnet(DEV)

    def run():
        for step in range(3):
            resnet_step(model, opt, DEV, step, batch=32)

    return run


def vit_b16_infer_b32_x3():
    """torchvision's ViT-B/16, three inference passes, batch 32 at 224x224 (the torch judge's)."""
    from torch_judge import build_vit, run_vit

    model = build_vit(DEV)

    def run():
        for i in range(3):
            run_vit(model, DEV, batch=32, seed=i)

    return run


WORKLOADS = {
    "vit_infer_b16": vit_infer_b16,
    "cnn_train_b64": cnn_train_b64,
    "lstm_train_b32_s128": lstm_train_b32_s128,
    "decoder_serving_mix": decoder_serving_mix,
    "gpt2_decode_kv_small": gpt2_decode_kv_small,
    "resnet50_train_b32_x3": resnet50_train_b32_x3,
    "vit_b16_infer_b32_x3": vit_b16_infer_b32_x3,
}


def record(name, make, out_dir, cold=False):
    torch.manual_seed(0)
    if cold:
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=10_000_000)
    run = make()
    run()  # warm-up: parameters, optimizer state, cuBLAS workspaces
    torch.cuda.synchronize()
    if not cold:
        torch.cuda.memory._record_memory_history(max_entries=10_000_000)
    run()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    ids, streams, lines = {}, {}, []
    live = peak = 0
    sizes = {}
    for e in trace:
        action = e["action"]
        if action == "alloc":
            i = len(sizes)
            s = streams.setdefault(e["stream"], len(streams))
            ids[e["addr"]] = i
            sizes[i] = e["size"]
            lines.append(f"a {i} {e['size']} {s}")
            live += e["size"]
            peak = max(peak, live)
        elif action == "free_requested" and e["addr"] in ids:
            i = ids.pop(e["addr"])
            lines.append(f"f {i}")
            live -= sizes[i]
    if cold:
        name += "_cold"
    path = os.path.join(out_dir, f"{name}.trace.gz")
    header = (
        f"# {name}: torch {torch.__version__}, {torch.cuda.get_device_name()}; "
        f"{make.__doc__.split(chr(10))[0]}{' From its build on.' if cold else ''} Recorded by scripts/record-traces.py; "
        "allocations still live at the end have no free line\n"
    )
    with gzip.open(path, "wt") as f:
        f.write(header)
        f.write("\n".join(lines) + "\n")
    print(f"{name}: {len(sizes)} allocations, {len(streams)} stream(s), "
          f"peak live {peak / 2**20:.1f} MiB -> {path}")
    del run
    torch.cuda.empty_cache()


def main():
    args = sys.argv[1:]
    cold = "--cold" in args
    args = [a for a in args if a != "--cold"]
    if not args:
        sys.exit(__doc__)
    out_dir = args[0]
    names = args[1:] or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    os.makedirs(out_dir, exist_ok=True)
    for n in names:
        record(n, WORKLOADS[n], out_dir, cold)


if __name__ == "__main__":
    main()
