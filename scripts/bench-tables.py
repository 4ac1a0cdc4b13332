#!/usr/bin/env python3
"""Write the opening tables of BENCHMARKS.md from one run's raw outputs.

    scripts/bench-tables.py benchmarks/runs/<run>      # rewrites BENCHMARKS.md in place
    scripts/bench-tables.py --check benchmarks/runs/<run>  # exits 1 if BENCHMARKS.md is stale

A run directory holds the outputs of one GPU machine, in one go:

- `machine.txt`: the GPU, driver and commit, as free text (first lines are shown);
- any `*.txt` file whose lines read `<impl> <metric> [key=value ...] <number>` (the format of
  the anchors' `side_by_side*.sh` and of pinpool's benchmark programs): `host.txt` from
  `side_by_side.sh`, `device.txt` from `side_by_side_device.sh`, `serve.txt` from
  `scripts/serve-compare.sh`, `torch.txt` from `scripts/torch-judge.sh`.

Each area below becomes one table: a row per (metric, keys), a column per implementation
seen, and the ratio of pinpool to the best of the others (lower is better unless the metric
is a rate). A `base` column, where present, is pinpool built from an earlier commit and run
in the same go (`scripts/gpu-bench.sh`): the change's before and after. The text between the two markers of BENCHMARKS.md is replaced; everything else
in the file stays as written.
"""
import os
import re
import sys
from collections import OrderedDict, defaultdict

BEGIN = "<!-- tables: begin (scripts/bench-tables.py writes this part; do not edit) -->"
END = "<!-- tables: end -->"

# (title, source file stem, metric prefixes, the command that produced the source)
AREAS = [
    ("Pinned memory: one thread", "host",
     ["pair_ns", "pair_with_record_ns", "mixed_sizes_ns_per_request"], "host"),
    ("Pinned memory: many threads", "host", ["mt_Mpairs_per_s"], "host"),
    ("Pinned memory: fresh memory", "host",
     ["fresh_alloc_ms", "reserved_MiB_for_request_MiB"], "host"),
    ("Device memory: one thread and many", "device",
     ["dev_pair_ns", "dev_pair_with_record_ns", "dev_mt_Mpairs_per_s",
      "dev_mixed_sizes_ns_per_request"], "device"),
    ("Device memory: fresh memory", "device",
     ["dev_fresh_alloc_ms", "dev_reserved_MiB_for_request_MiB"], "device"),
    ("Device memory: real request streams", "device",
     ["dev_replay_ns_per_request", "dev_replay_segments", "dev_replay_reserved_over_peak"],
     "device"),
    ("The inference server (`serve`), with and without its caps", "serve", ["serve_"], "serve"),
    ("PyTorch models on pinpool (`pinpool_torch`) and on PyTorch's allocators", "torch",
     ["model_"], "torch"),
]

COMMANDS = {
    "host": "scripts/gpu-bench.sh build .dev/bench; then on the GPU machine "
            "scripts/gpu-bench.sh run .dev/bench RUN_DIR (side_by_side.sh with gpu_bench --policy default)",
    "device": "the same run: EXTRA_TRACES=traces/*.trace.gz side_by_side_device.sh with device_bench",
    "serve": "the same run: scripts/serve-compare.sh serve 3 (default caps, and --max-mib 0 --device-max-mib 0)",
    "torch": "cargo build --release -p pinpool-torch --features cuda; "
             "scripts/torch-judge.sh target/release/libpinpool_torch.so OUT_DIR",
}

HIGHER_IS_BETTER = ("per_s", "GBps", "_pct")
LINE = re.compile(r"^(\S+) (\S+)((?: \S+=\S+)*) (-?[0-9.]+(?:e[-+]?[0-9]+)?)$")


def parse(path):
    """(metric, keys) -> {impl: value}, in the order first seen."""
    rows = OrderedDict()
    for raw in open(path, encoding="utf-8", errors="replace"):
        m = LINE.match(raw.strip())
        if not m:
            continue
        impl, metric, keys, value = m.group(1), m.group(2), m.group(3).strip(), m.group(4)
        if "=" in impl or impl[0].isdigit():
            continue
        try:
            number = float(value)
        except ValueError:  # a version, say: "NVIDIA H200, 580.159.04"
            continue
        rows.setdefault((metric, keys), OrderedDict())[impl] = number
    return rows


def fmt(v):
    if v is None:
        return "—"
    if abs(v) >= 100:
        return f"{v:,.0f}".replace(",", " ")
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def ratio(metric, values):
    """pinpool over the best other implementation (not its own baseline, `base`), and whether
    pinpool is at least as good."""
    p = values.get("pinpool")
    others = [v for k, v in values.items() if k not in ("pinpool", "base") and v]
    if p is None or not others:
        return "—"
    higher = metric.endswith(HIGHER_IS_BETTER)
    best = max(others) if higher else min(others)
    if best == 0:
        return "—"
    r = p / best
    good = r >= 1 if higher else r <= 1
    return f"{r:.2f}× {'✔' if good else '✘'}"


def table(title, rows, command_key):
    impls = []
    for values in rows.values():
        for k in values:
            if k not in impls:
                impls.append(k)
    order = {k: i for i, k in enumerate(impls)}
    impls.sort(key=lambda k: (k in ("base", "pinpool"), k == "pinpool", order[k]))
    out = [f"### {title}", "",
           "| metric | keys | " + " | ".join(impls) + " | pinpool / best other | command |",
           "| --- | --- | " + " | ".join("---:" for _ in impls) + " | ---: | --- |"]
    for (metric, keys), values in rows.items():
        cells = " | ".join(fmt(values.get(i)) for i in impls)
        out.append(f"| {metric} | {keys or '—'} | {cells} | {ratio(metric, values)} | [{command_key}] |")
    out.append("")
    return out


def render(run_dir):
    sources = {}
    for name in sorted(os.listdir(run_dir)):
        if name.endswith(".txt") and name != "machine.txt":
            sources[name[:-4]] = parse(os.path.join(run_dir, name))
    machine = ""
    mpath = os.path.join(run_dir, "machine.txt")
    if os.path.exists(mpath):
        machine = " ".join(l.strip() for l in open(mpath) if l.strip())
    out = [BEGIN, "", f"Run `{os.path.basename(os.path.normpath(run_dir))}`: {machine}".rstrip(), ""]
    used = defaultdict(set)
    keys_seen = []
    for title, stem, prefixes, command_key in AREAS:
        rows = OrderedDict()
        for key, values in sources.get(stem, {}).items():
            if any(key[0].startswith(p) for p in prefixes):
                rows[key] = values
                used[stem].add(key)
        if rows:
            out += table(title, rows, command_key)
            keys_seen.append(command_key)
    for stem, rows in sources.items():
        rest = OrderedDict((k, v) for k, v in rows.items() if k not in used[stem])
        if rest:
            out += table(f"Other figures ({stem}.txt)", rest, stem)
            keys_seen.append(stem)
    out.append("Commands (run on the GPU machine from the repository root; the raw outputs are in "
               f"`{os.path.normpath(run_dir)}/`):")
    out.append("")
    for key in dict.fromkeys(keys_seen):
        out.append(f"- [{key}] `{COMMANDS.get(key, 'see the raw output')}`")
    out += ["", END]
    return "\n".join(out)


def main(argv):
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    if len(args) != 1:
        sys.exit(__doc__)
    text = open("BENCHMARKS.md", encoding="utf-8").read()
    if BEGIN not in text or END not in text:
        sys.exit("BENCHMARKS.md has no generated part (its markers are missing)")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + render(args[0]) + tail
    if check:
        sys.exit(0 if new == text else "BENCHMARKS.md is not what scripts/bench-tables.py writes")
    open("BENCHMARKS.md", "w", encoding="utf-8").write(new)


if __name__ == "__main__":
    main(sys.argv[1:])
