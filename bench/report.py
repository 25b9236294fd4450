#!/usr/bin/env python3
"""Turns bench/run.sh's results (one JSON object per line, from hp_bench and
fsdp2_bench.py) into docs/performance.md, and prints its tables.

Every number in the document comes from the results file of the run that wrote it;
sentences that depend on timings are generated from them. The fixed text explains
mechanisms that do not change from run to run (what Gloo copies and sends, how the
variants are built).

Each section of the document is written by the module of its bench/run.sh section in
bench/sections/; bench/reporting/ holds what they share. This file only dispatches.
"""

import argparse
import os
import sys

from reporting.document import document, splice
from reporting.results import Report, load
from sections import MEASURED, conclusion, introduction, target_section


def arguments():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", nargs="+", required=True, help="run.sh's SECTION.jsonl files")
    ap.add_argument("--only", default="", help="the run.sh sections just run (default: all)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--load-before", default="?")
    ap.add_argument("--load-after", default="?")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--netns-steps", type=int, default=10)
    ap.add_argument("--malloc", default="")
    ap.add_argument("--memory-malloc", default="")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rate", default="?")
    return ap.parse_args()


def main():
    args = arguments()
    rep = Report([r for path in args.results for r in load(path)], target_section)
    introduction.write(rep, args)
    for section in MEASURED:
        section.write(rep, args)
    conclusion.write(rep)

    only = [x for x in args.only.split(",") if x]
    if only and os.path.exists(args.out):
        with open(args.out) as f:
            text = splice(f.read(), rep, only)
    else:
        text = document(rep)
    with open(args.out, "w") as f:
        f.write(text)
    start, end = text.find("## Step time"), text.find("## Discussion")
    print(text[start:end].rstrip())
    print(f"\nreport: wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
