#!/usr/bin/env python3
"""Fails when a module of the engine (`actors/src`) uses a module listed after it.

The engine's layers are the folders under `actors/src`: the order of the layers is the order
of the `mod` lines in `actors/src/lib.rs` (bottom layer first), and the order of the modules
inside a layer is the order of the `mod` lines in that layer's `mod.rs`. Flattened layer by
layer, module by module, a module may use only modules declared before it, so that the engine
reads top-down with no import circle. Every `crate::<layer>::<module>` path in code counts
(`use` lines and inline paths alike, `crate::<layer>::{...}` and `crate::{...}` groups
included); comments do not. A module's files are `<layer>/<module>.rs` or everything under
`<layer>/<module>/`. Every file and folder under `actors/src` must belong to a declared layer
and module.

    python3 scripts/check-layers.py            # exit 1 and one line per upward edge
    python3 scripts/check-layers.py --graph    # also print each module's edges
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "actors" / "src"
MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.M)
CRATE_USE = re.compile(r"\bcrate::")


def strip_comments(text: str) -> str:
    """Drops `//` comments (doc comments included) and string literals' contents."""
    out = []
    for line in text.splitlines():
        line = re.sub(r'"(?:\\.|[^"\\])*"', '""', line)
        i = line.find("//")
        out.append(line if i < 0 else line[:i])
    return "\n".join(out)


def use_tree(code: str, pos: int, prefix: list, found: list) -> int:
    """Reads the path (or `{...}` group of paths) at `pos`; appends each path's first two
    segments after `crate::` to `found`; returns the position after it."""
    while True:
        while pos < len(code) and code[pos].isspace():
            pos += 1
        if pos < len(code) and code[pos] == "{":
            pos += 1
            while True:
                pos = use_tree(code, pos, prefix, found)
                while pos < len(code) and code[pos].isspace():
                    pos += 1
                if pos >= len(code) or code[pos] == "}":
                    return pos + 1
                pos += 1  # the comma
        m = re.compile(r"\w+").match(code, pos)
        if not m:
            found.append(prefix[:2])
            return pos
        prefix = prefix + [m.group(0)]
        pos = m.end()
        if code.startswith("::", pos) and len(prefix) < 2:
            pos += 2
            continue
        found.append(prefix[:2])
        return pos


def uses(path: pathlib.Path):
    code = strip_comments(path.read_text())
    found = []
    for m in CRATE_USE.finditer(code):
        use_tree(code, m.end(), [], found)
    return {tuple(p) for p in found if len(p) == 2}


def main() -> int:
    layers = MOD_DECL.findall((ROOT / "lib.rs").read_text())
    order = []  # (layer, module), bottom up
    for layer in layers:
        for m in MOD_DECL.findall((ROOT / layer / "mod.rs").read_text()):
            order.append((layer, m))
    rank = {lm: i for i, lm in enumerate(order)}
    bad = []
    for layer, m in order:
        files = [ROOT / layer / f"{m}.rs"] if (ROOT / layer / f"{m}.rs").exists() else []
        if (ROOT / layer / m).is_dir():
            files += sorted((ROOT / layer / m).rglob("*.rs"))
        if not files:
            bad.append(f"actors/src/{layer}/mod.rs declares `{m}`, which has no file")
        edges = set()
        for f in files:
            for used in uses(f):
                if used in rank and used != (layer, m):
                    edges.add(used)
                    if rank[used] > rank[(layer, m)]:
                        bad.append(f"{f.relative_to(ROOT.parent.parent)}: `{layer}::{m}` uses "
                                   f"`{used[0]}::{used[1]}`, which is declared after it "
                                   f"(module #{rank[(layer, m)] + 1} uses #{rank[used] + 1})")
        if "--graph" in sys.argv:
            print(f"{m}: {', '.join(u[1] for u in sorted(edges, key=rank.get)) or '-'}")
    for f in sorted(ROOT.iterdir()):
        if f.name != "lib.rs" and f.stem not in layers:
            bad.append(f"actors/src/{f.name} is not a layer declared in lib.rs")
    for layer in layers:
        for f in sorted((ROOT / layer).iterdir()):
            if f.name != "mod.rs" and (layer, f.stem) not in rank:
                bad.append(f"actors/src/{layer}/{f.name} is not declared in {layer}/mod.rs")
    for line in bad:
        print(line)
    if bad:
        print(f"{len(bad)} problem(s): a lower layer must not name a higher one "
              "(see the layer list at the top of actors/src/lib.rs)", file=sys.stderr)
        return 1
    print(f"layers ok: {len(layers)} layers, {len(order)} modules, "
          "every crate:: edge points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
