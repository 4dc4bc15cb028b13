#!/usr/bin/env python3
"""Old vs new Python binding, alternated: runs ``bench.py`` for the package of git revision
``--old`` (default ``main``) and for this checkout's package, ``--rounds`` times each in turn,
against the same library, and prints the median of each figure over the rounds.

Usage: KVOFFLOAD_LIB=target/release/libkvoffload.so python3 python/bench/compare.py
       [--old REV] [--rounds N] [--trace PATH] [--quick]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import io

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, os.pardir, os.pardir))


def old_package(rev, into):
    """Extracts ``python/kvoffload`` of ``rev`` into ``into``; returns the directory to import
    it from."""
    data = subprocess.run(["git", "archive", rev, "python/kvoffload"], cwd=ROOT, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        t.extractall(into)
    return os.path.join(into, "python")


def run(package, extra):
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "bench.py"), "--package", package, "--json", *extra],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", default="main")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trace")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    extra = (["--trace", a.trace] if a.trace else []) + (["--quick"] if a.quick else [])
    with tempfile.TemporaryDirectory() as d:
        packages = {"old": old_package(a.old, d), "new": os.path.join(ROOT, "python")}
        figures = {"old": {}, "new": {}}
        library = None
        for r in range(a.rounds):
            for which in ("old", "new") if r % 2 == 0 else ("new", "old"):
                got = run(packages[which], extra)
                library = got["library"]
                for name, v in got["results"].items():
                    figures[which].setdefault(name, []).append(v)
                print(f"round {r + 1}/{a.rounds} {which} done", file=sys.stderr, flush=True)
    print(f"library {library}; old = python/kvoffload of {a.old}; medians of {a.rounds} "
          "alternated rounds (each a median of repeats); us per call unless said; wall clock "
          "and the calling thread's CPU clock")
    print(f"{'case':58s} {'old wall':>9s} {'new wall':>9s} {'old CPU':>9s} {'new CPU':>9s}")
    names = list(figures["new"]) + [n for n in figures["old"] if n not in figures["new"]]
    for name in names:
        cells = []
        for clock in (0, 1):
            for which in ("old", "new"):
                v = figures[which].get(name)
                cells.append(f"{statistics.median(x[clock] for x in v):9.3f}" if v
                             else f"{'-':>9s}")
        print(f"{name:58s} " + " ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
