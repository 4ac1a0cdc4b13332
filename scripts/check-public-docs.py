#!/usr/bin/env python3
"""Fails when pinpool's public documentation names something a user cannot reach.

The user's documentation (the front page, the public modules, every public item) speaks of
allocators, buffers, streams, caps and statistics; the engine's internals are described in
`actors/ARCHITECTURE.md`. This check builds the crate's rustdoc (`cargo doc --features cuda`,
with rustdoc's warnings as errors: broken links, and links to private items) and reads
every public page's doc text:

- a code span naming a type (struct, enum, trait, type alias) that the sources declare but
  the public API does not reach (`Engine` is reachable through `pinpool::tuning`, so it may be
  named; `EngineBuilder` is not);
- a code span with a path through a private module (`device::raw`, `actors::miss`);
- a source path (`actors/src/...`, `*.rs`), or a contributor's note (`invariant 7`,
  `ARCHITECTURE.md`, "to add a key").

Every public module's page carries an example (a doc test: `cargo test --doc` runs it).

It also reads the text the main example, `serve`, prints (its string literals): it speaks to
users too, so engine words (granules, actors, shards, the engine) stay out of it.

    python3 scripts/check-public-docs.py             # builds the docs, exit 1 on findings
    python3 scripts/check-public-docs.py --no-build  # reads target/doc as it is
"""

import html
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "target" / "doc" / "pinpool"
SOURCES = [ROOT / "src", ROOT / "actors" / "src"]

# Types at any depth; aliases only at an item's place (`type X` inside an impl or a trait is
# an associated type, named through its trait: `Runtime::Event`).
TYPE_DECL = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:struct|enum|trait|union)\s+([A-Z]\w*)"
    r"|^(?:pub(?:\([^)]*\))?\s+)?type\s+([A-Z]\w*)",
    re.M,
)
MOD_DECL = re.compile(r"^\s*(pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*[;{]", re.M)
CODE_SPAN = re.compile(r"<code>(.*?)</code>", re.S)
PRE = re.compile(r"<pre\b.*?</pre>", re.S)
TAG = re.compile(r"<[^>]+>")
DOCBLOCK_START = re.compile(r'<div class="docblock[^"]*">')
NOTES = [
    (re.compile(r"\binvariant \d"), "a contributor's note (invariant N)"),
    (re.compile(r"ARCHITECTURE\.md"), "the engine's architecture notes"),
    (re.compile(r"\bto add a key\b", re.I), "a contributor's note (to add a key)"),
    (re.compile(r"\bactors/"), "a source path of the engine"),
    (re.compile(r"\b[\w/]+\.rs\b"), "a source file"),
]
# Private module names without an underscore that are no everyday word either (a span
# `stream` or `error` is a parameter or a word, not the module).
DISTINCT = {"memviz", "ledger", "grammar", "keepalive", "carve", "mailbox", "peaks", "poller", "router", "errand", "lease", "loom", "shard", "pickle", "expandable", "violation", "worker", "actors", "miss", "budget", "holder", "counters", "meta", "observe", "parked", "ready", "home", "spawn", "fault", "rng", "choices"}
# Names of the standard library's that sources here declare too (`Range`, an associated
# `Item`): a span naming them means std's.
STD = {"Range", "Item", "Err", "Ok", "Output", "Error", "Result", "Option", "Some", "None"}
# Names that are not this crate's: paths and spans naming them are fine.
FOREIGN = {"std", "core", "alloc", "tokio", "cudarc", "serde", "crate", "self", "super", "Self", "pinpool", "torch", "flume"}


def build() -> None:
    env = dict(
        **__import__("os").environ,
        RUSTDOCFLAGS="-D warnings",
    )
    subprocess.run(
        ["cargo", "doc", "-p", "pinpool", "--no-deps", "--features", "cuda"],
        cwd=ROOT,
        env=env,
        check=True,
    )


def public_names() -> tuple[set[str], set[str], set[str]]:
    """Names of the public items (last path segment), of the public modules, and of every
    public method, field and variant (words a doc may name alone)."""
    text = (DOC / "all.html").read_text()
    items = set(re.findall(r'href="[^"]*?(?:struct|enum|trait|type|union|fn|constant|macro)\.(\w+)\.html"', text))
    mods = {"pinpool"}
    members = set()
    for page in DOC.rglob("*.html"):
        if not is_public_page(page):
            continue
        if page.name == "index.html":
            mods.update(page.relative_to(DOC).parent.parts)
        members.update(
            re.findall(r'id="(?:method|tymethod|structfield|variant|field)\.(\w+)"', page.read_text())
        )
    return items, mods, members


def declared() -> tuple[set[str], set[str]]:
    """Type names and module names the sources declare."""
    types, mods = set(), set()
    for src in SOURCES:
        for f in src.rglob("*.rs"):
            text = f.read_text()
            types.update(a or b for a, b in TYPE_DECL.findall(text))
            mods.update(name for _, name in MOD_DECL.findall(text))
            if f.name != "mod.rs" and f.name != "lib.rs":
                mods.add(f.stem)
    return types, mods


def is_public_page(page: pathlib.Path) -> bool:
    """Rustdoc writes redirect pages for items re-exported from private modules."""
    head = page.read_text(errors="replace")[:2000]
    return "Redirection" not in head and "http-equiv=\"refresh\"" not in head


def docblocks(text: str):
    """The doc text of a page: every `docblock` div, nested divs included."""
    for m in DOCBLOCK_START.finditer(text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            nxt_open = text.find("<div", i)
            nxt_close = text.find("</div>", i)
            if nxt_close < 0:
                break
            if 0 <= nxt_open < nxt_close:
                depth += 1
                i = nxt_open + 4
            else:
                depth -= 1
                i = nxt_close + 6
        yield text[m.end() : i]


SERVE = ROOT / "examples" / "serve.rs"
ENGINE_WORDS = re.compile(r"\b(granules?|engines?|actors?|shards?|carv\w+)\b", re.I)
STRING = re.compile(r'"((?:\\.|[^"\\])*)"')


def serve_findings() -> list[str]:
    """Engine words in the string literals of `serve` (what it prints)."""
    out = []
    for n, line in enumerate(SERVE.read_text().splitlines(), 1):
        code = line.split("//", 1)[0] if not line.lstrip().startswith('"') else line
        for lit in STRING.findall(code):
            for word in ENGINE_WORDS.findall(lit):
                out.append(f"examples/serve.rs:{n}: an engine word in what serve prints: {word!r}")
    return out


def main() -> int:
    if "--no-build" not in sys.argv:
        build()
    public_items, public_mods, members = public_names()
    types, mods = declared()
    private_types = types - public_items - STD
    private_mods = mods - public_mods
    # A private module named alone: only names that are no public word as well.
    alone = {m for m in private_mods - members - public_items - FOREIGN if "_" in m or m in DISTINCT}
    findings = []
    for page in sorted(DOC.rglob("*.html")):
        if not is_public_page(page):
            continue
        where = page.relative_to(DOC)
        for block in docblocks(page.read_text()):
            prose = PRE.sub(" ", block)
            plain = html.unescape(TAG.sub("", prose))
            for pattern, what in NOTES:
                for hit in pattern.findall(plain):
                    findings.append(f"{where}: {what}: {hit!r}")
            for span in CODE_SPAN.findall(prose):
                code = html.unescape(TAG.sub("", span))
                for head in re.findall(r"\b(\w+)::", code):
                    if head in private_mods and head not in FOREIGN:
                        findings.append(f"{where}: a path through private module `{head}`: `{code}`")
                if code in alone:
                    findings.append(f"{where}: private module `{code}`")
                for word in re.findall(r"\b[A-Z]\w*\b", code):
                    if word in private_types:
                        findings.append(f"{where}: private type `{word}`: `{code}`")
    for index in sorted(DOC.rglob("index.html")):
        if is_public_page(index) and "rust-example-rendered" not in index.read_text():
            findings.append(f"{index.relative_to(DOC)}: a public module without an example")
    findings += serve_findings()
    for f in sorted(set(findings)):
        print(f)
    if findings:
        print(f"{len(set(findings))} finding(s): public docs name what users cannot reach", file=sys.stderr)
        return 1
    print("public docs ok: no private item, source path or contributor's note")
    return 0


if __name__ == "__main__":
    sys.exit(main())
