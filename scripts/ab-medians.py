#!/usr/bin/env python3
"""Medians of interleaved runs, one column per variant, from lines `NAME ROUND METRIC KEYS...
VALUE` (what scripts/device-ab.sh writes).

Usage: scripts/ab-medians.py FILE... [--grep SUBSTRING]...

Rows keep the order in which metrics first appear; --grep keeps only metrics that contain one
of the substrings (for instance --grep warm_ns --grep reserved_over).
"""

import statistics
import sys


def main(argv):
    files, wanted = [], []
    it = iter(argv)
    for a in it:
        if a == "--grep":
            wanted.append(next(it, ""))
        else:
            files.append(a)
    if not files:
        sys.exit(__doc__)
    values, variants = {}, []
    for path in files:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                name, metric, keys = parts[0], parts[2], " ".join(parts[3:-1])
                try:
                    value = float(parts[-1])
                except ValueError:
                    continue
                if wanted and not any(w in metric for w in wanted):
                    continue
                if name not in variants:
                    variants.append(name)
                values.setdefault((metric, keys), {}).setdefault(name, []).append(value)
    rows = [["metric", "keys"] + variants]
    for (metric, keys), by_variant in values.items():
        cells = []
        for v in variants:
            got = by_variant.get(v)
            cells.append(f"{statistics.median(got):.4g}" if got else "-")
        rows.append([metric, keys] + cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main(sys.argv[1:])
