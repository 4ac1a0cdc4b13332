#!/usr/bin/env python3
"""Fails when a library source file or a function in one is too long to read whole.

Library files are the tracked `.rs` files under `src/`, `actors/src/`, `torch/src/` and
`tools/src/`, less test modules (`tests.rs`, `gpu_tests.rs`, anything under a `tests/`
folder). In them:

- a file has at most `MAX_FILE_LINES` lines (an inline `#[cfg(test)] mod tests { ... }`
  counts: move it to its own file);
- a function (body and signature, from its `fn` line to its closing brace) has at most
  `MAX_FN_LINES` lines; functions inside an inline `#[cfg(test)]` module are not counted.

A file or function too long to split along a real seam may be named in `ALLOWED`, with a
comment saying why; it is empty, and should stay so.

    python3 scripts/check-sizes.py     # exit 1 and one line per offender
"""

import pathlib
import re
import subprocess
import sys

MAX_FILE_LINES = 600
MAX_FN_LINES = 80
LIBRARY_ROOTS = ("src/", "actors/src/", "torch/src/", "tools/src/")
TEST_FILES = ("tests.rs", "gpu_tests.rs")

# Exceptions, as "path" (the file's length) or "path::function" entries, each with a comment
# saying why it cannot be split.
ALLOWED: set = set()

ROOT = pathlib.Path(__file__).resolve().parent.parent
FN = re.compile(r"\bfn\s+(\w+)")
TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")


def library_files():
    listed = subprocess.check_output(["git", "ls-files", "*.rs"], cwd=ROOT, text=True)
    for name in listed.split():
        parts = name.split("/")
        if not name.startswith(LIBRARY_ROOTS) or parts[-1] in TEST_FILES or "tests" in parts[:-1]:
            continue
        yield name


def blank(text: str) -> str:
    """The code with comments, strings and character literals blanked (newlines kept), so that
    every brace, bracket and `fn` left is code."""
    out = list(text)
    i, n = 0, len(text)

    def wipe(a, b):
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif (m := re.compile(r'b?r(#*)"').match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            wipe(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            wipe(i, j + 1)
            i = j + 1
        elif c == "'":
            if text.startswith("\\", i + 1):
                j = text.find("'", i + 2)
                wipe(i, j + 1)
                i = j + 1
            elif i + 2 < n and text[i + 2] == "'":
                wipe(i, i + 3)
                i += 3
            else:
                i += 1  # a lifetime
        else:
            i += 1
    return "".join(out)


def close_of(code: str, pos: int) -> int:
    """The position just past the brace closing the one at `pos`."""
    depth = 0
    for j in range(pos, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


def long_functions(code: str):
    """(name, first line, length in lines) of each function longer than the limit."""
    skip = [(m.start(), close_of(code, m.end() - 1)) for m in TEST_MOD.finditer(code)]
    pos = 0
    while (m := FN.search(code, pos)):
        pos = m.end()
        if any(a <= m.start() < b for a, b in skip):
            continue
        depth = 0
        for j in range(m.end(), len(code)):
            ch = code[j]
            if ch in "([<" and not code.startswith("->", j - 1):
                depth += ch != "<"
            elif ch in ")]":
                depth -= 1
            elif depth == 0 and ch == ";":
                break  # no body
            elif depth == 0 and ch == "{":
                end = close_of(code, j)
                first = code.count("\n", 0, m.start()) + 1
                last = code.count("\n", 0, end - 1) + 1
                if last - first + 1 > MAX_FN_LINES:
                    yield m.group(1), first, last - first + 1
                pos = end
                break


def main() -> int:
    bad = []
    for name in library_files():
        text = (ROOT / name).read_text()
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_FILE_LINES and name not in ALLOWED:
            bad.append(f"{name}: {lines} lines (at most {MAX_FILE_LINES})")
        for fn, line, length in long_functions(blank(text)):
            if f"{name}::{fn}" not in ALLOWED:
                bad.append(f"{name}:{line}: fn {fn} is {length} lines (at most {MAX_FN_LINES})")
    for line in bad:
        print(line)
    if bad:
        print(f"{len(bad)} too long: split files into modules that each own one concept, "
              "and functions into named steps", file=sys.stderr)
        return 1
    print(f"sizes ok: no library file over {MAX_FILE_LINES} lines, "
          f"no function over {MAX_FN_LINES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
