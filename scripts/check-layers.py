#!/usr/bin/env python3
"""Fails when a module of the engine (`actors/src`) uses a module listed after it.

`actors/src/lib.rs` declares its modules from the bottom layer up; a module may use only
modules declared before it, so that the engine reads top-down with no import circle. Every
`crate::<module>` path in code counts (`use` lines and inline paths alike); comments do not.
A module's files are `<module>.rs` or everything under `<module>/`.

    python3 scripts/check-layers.py            # exit 1 and one line per upward edge
    python3 scripts/check-layers.py --graph    # also print each module's edges
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "actors" / "src"
MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.M)
CRATE_PATH = re.compile(r"\bcrate::(\w+)")
USE_GROUP = re.compile(r"\bcrate::\{([^}]*)\}", re.S)


def strip_comments(text: str) -> str:
    """Drops `//` comments (doc comments included) and string literals' contents."""
    out = []
    for line in text.splitlines():
        line = re.sub(r'"(?:\\.|[^"\\])*"', '""', line)
        i = line.find("//")
        out.append(line if i < 0 else line[:i])
    return "\n".join(out)


def module_files(name: str):
    single = ROOT / f"{name}.rs"
    if single.exists():
        yield single
    folder = ROOT / name
    if folder.is_dir():
        yield from sorted(folder.rglob("*.rs"))


def uses(path: pathlib.Path):
    code = strip_comments(path.read_text())
    found = set(CRATE_PATH.findall(code))
    for group in USE_GROUP.findall(code):
        for item in group.split(","):
            item = item.strip()
            if item:
                found.add(re.split(r"\W", item)[0])
    return found


def main() -> int:
    order = MOD_DECL.findall((ROOT / "lib.rs").read_text())
    rank = {m: i for i, m in enumerate(order)}
    bad = []
    for m in order:
        edges = set()
        for f in module_files(m):
            for used in uses(f):
                if used in rank and used != m:
                    edges.add(used)
                    if rank[used] > rank[m]:
                        bad.append(f"{f.relative_to(ROOT.parent.parent)}: `{m}` uses `{used}`, "
                                   f"which lib.rs lists above it (layer order: {m} is "
                                   f"#{rank[m] + 1}, {used} is #{rank[used] + 1})")
        if "--graph" in sys.argv:
            print(f"{m}: {', '.join(sorted(edges, key=rank.get)) or '-'}")
    missing = [f.stem for f in ROOT.glob("*.rs") if f.stem not in rank and f.stem != "lib"]
    for m in missing:
        bad.append(f"actors/src/{m}.rs is not declared in lib.rs")
    for line in bad:
        print(line)
    if bad:
        print(f"{len(bad)} upward edge(s): a lower layer must not name a higher one "
              "(see the layer list at the top of actors/src/lib.rs)", file=sys.stderr)
        return 1
    print(f"layers ok: {len(order)} modules, every crate:: edge points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
