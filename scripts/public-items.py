#!/usr/bin/env python3
"""Counts the public items of the workspace's crates, from stable rustdoc output.

    scripts/public-items.py                     # the published crates, default features
    scripts/public-items.py --features cuda     # with the CUDA runtime's items too
    scripts/public-items.py -p pinpool --list   # and name every item counted

The crates counted are the workspace's published ones (`publish = false` crates, such as the
tests' testkit and the benchmarks' tools, are no one's API; `-p` counts any crate). For each
crate it runs `cargo doc --no-deps -p CRATE` and reads the generated pages:

- items: the entries of `all.html` (structs, enums, unions, traits, functions, macros, type
  aliases, constants, statics), plus modules (one `index.html` each, the crate root left out);
- members: on each struct, enum, union and trait page, the anchors of the item's own fields
  (`structfield.`), variants (`variant.`, not their fields), inherent methods, associated
  constants and types, and a trait's required and provided methods. Trait implementations,
  auto-trait and blanket implementations, methods reached through `Deref`, and a type alias's
  view of the type it names are not counted: they are not promises of their own.

Items re-exported from another crate and inlined in this one's docs are counted in every
crate whose docs show them (a user reaches them there); the `own` column counts only the
items (and their members) defined in the crate itself, so that summed over the crates each
item counts once. A re-export marked `#[doc(no_inline)]` has no page of its own and counts
only where it is defined. `#[doc(hidden)]` items are invisible to this count, so hiding an
item does not make it private: make it `pub(crate)` instead.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter

# The crates with a `cuda` feature (what --features applies to).
FEATURED = ["pinpool", "pinpool-torch"]
ITEM_KINDS = [
    "structs",
    "enums",
    "unions",
    "traits",
    "functions",
    "macros",
    "types",
    "constants",
    "statics",
]
MEMBER_KINDS = {
    "method": "methods",
    "tymethod": "methods",
    "structfield": "fields",
    "variant": "variants",
    "associatedconstant": "assoc",
    "associatedtype": "assoc",
}
# Sections of an item page that follow the item's own members.
CUT = re.compile(
    r'<h2 id="(deref-methods[^"]*|trait-implementations|synthetic-implementations|'
    r'blanket-implementations|foreign-impls|implementors|object-safety|dyn-compatibility)"'
)
ANCHOR = re.compile(r'id="(method|tymethod|structfield|variant|associatedconstant|associatedtype)\.([^"]+)"')


def metadata():
    meta = subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(meta.stdout)


def published(meta):
    """The workspace's crates that can be published (`publish` not set to false)."""
    return [p["name"] for p in meta["packages"] if p.get("publish") != []]


def count(crate, doc_root, listing):
    name_here = crate.replace("-", "_")
    root = os.path.join(doc_root, name_here)
    html = open(os.path.join(root, "all.html"), encoding="utf-8").read()
    items = Counter()
    members = Counter()
    own = 0
    pages = []
    for kind in ITEM_KINDS:
        m = re.search(r'<h3 id="%s">.*?<ul class="all-items">(.*?)</ul>' % kind, html, re.S)
        if not m:
            continue
        for href, name in re.findall(r'<a href="([^"]+)">([^<]+)</a>', m.group(1)):
            items[kind] += 1
            pages.append((kind, href, name))
    for dirpath, _, files in os.walk(root):
        if "index.html" in files and dirpath != root:
            items["modules"] += 1
            own += 1
            if listing:
                print(f"  module {os.path.relpath(dirpath, root).replace(os.sep, '::')}")
    for kind, href, name in pages:
        found = Counter()
        page = open(os.path.join(root, href), encoding="utf-8").read()
        src = re.search(r'class="src[^"]*" href="(?:\.\./)*src/([^/"]+)/', page)
        defined_here = src is None or src.group(1) == name_here
        if kind in ("structs", "enums", "unions", "traits"):
            cut = CUT.search(page)
            if cut:
                page = page[: cut.start()]
            for anchor, rest in ANCHOR.findall(page):
                # A struct-like variant's fields, and the heading over them
                # (`variant.X.fields`), belong to the variant.
                if anchor == "variant" and (".field." in rest or rest.endswith(".fields")):
                    continue
                found[MEMBER_KINDS[anchor]] += 1
        members.update(found)
        if defined_here:
            own += 1 + sum(found.values())
        if listing:
            extra = ", ".join(f"{n} {k}" for k, n in sorted(found.items()))
            origin = "" if defined_here else f" [from {src.group(1)}]"
            print(f"  {kind[:-1]} {name}" + (f" ({extra})" if extra else "") + origin)
    return items, members, own


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--package", action="append", help="crate(s) to count (default: all)")
    ap.add_argument("--features", default="", help="features of pinpool and pinpool-torch, e.g. cuda")
    ap.add_argument("--list", action="store_true", help="name every item counted")
    ap.add_argument("--no-build", action="store_true", help="read existing docs")
    args = ap.parse_args()
    meta = metadata()
    crates = args.package or published(meta)
    doc_root = os.path.join(meta["target_directory"], "doc")
    totals = Counter()
    rows = []
    if not args.no_build:
        cmd = ["cargo", "doc", "--no-deps", "-q"]
        for crate in crates:
            cmd += ["-p", crate]
        if args.features:
            feats = [f"{c}/{f}" for f in args.features.split(",") for c in FEATURED]
            cmd += ["--features", ",".join(feats)]
        subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    for crate in crates:
        if args.list:
            print(crate)
        items, members, own = count(crate, doc_root, args.list)
        n_items, n_members = sum(items.values()), sum(members.values())
        rows.append((crate, items, members, n_items, n_members, own))
        totals["items"] += n_items
        totals["members"] += n_members
        totals["own"] += own
    print(f"{'crate':<16} {'items':>6} {'members':>8} {'total':>6} {'own':>6}   detail")
    for crate, items, members, n_items, n_members, own in rows:
        detail = ", ".join(f"{n} {k}" for k, n in sorted((items + members).items()))
        total = n_items + n_members
        print(f"{crate:<16} {n_items:>6} {n_members:>8} {total:>6} {own:>6}   {detail}")
    print(
        f"{'all':<16} {totals['items']:>6} {totals['members']:>8} "
        f"{totals['items'] + totals['members']:>6} {totals['own']:>6}"
    )


if __name__ == "__main__":
    sys.exit(main())
