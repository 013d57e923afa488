"""python -m mha_report RESULTS.json [--baseline OLD.json] --out DIR

Writes DIR/report.md with its PNG figures and DIR/report.html (self-contained), and prints
the summary table (the fastest kernel against the fastest peer, per shape), then, when the run
has them, the GEMM table (the fastest kernel against the fastest library and peer) and the
layer table (the project's layer against the peer and the composed baselines)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .render import build, summary_text, write
from .results import load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mha_report", description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="mha_bench JSON (--benchmark_out)")
    ap.add_argument("--baseline", type=Path, help="an earlier run to compare with")
    ap.add_argument("--out", type=Path, required=True, help="folder for the report")
    args = ap.parse_args(argv)
    try:
        results = load(args.results)
        baseline = load(args.baseline) if args.baseline else None
    except (OSError, ValueError) as e:
        print(f"mha_report: cannot read results: {e}", file=sys.stderr)
        return 2
    if not results.runs:
        print(f"mha_report: {args.results} holds no mha_bench results", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    md, page = write(build(results, args.out, baseline), args.out)
    print(summary_text(results))
    print(f"\nmha_report: {md} and {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
