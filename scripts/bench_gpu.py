#!/usr/bin/env python3
"""The speed report on a GPU machine, bf16 and 4-bit NF4 in one command.

    python -m scripts.bench_gpu [--model M] [--quants bf16,nf4] [--out DIR] [bench flags...]

Runs `python launcher.py bench` once per quantization (same prompts, methods and settings,
device auto = CUDA when present) into DIR/<quant>/ and writes DIR/summary.md with the
overall and per-category tables side by side. It runs on a CPU too (slowly), which is how
the test suite keeps it working. Like the launcher, it first makes sure the pinned
environment (.venv) exists and re-runs itself inside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

DEFAULT_QUANTS = "bf16,nf4"
DEFAULT_OUT = "bench-gpu"


def build_parser() -> argparse.ArgumentParser:
    from app.commands import bench

    parser = argparse.ArgumentParser(prog="python -m scripts.bench_gpu",
                                     description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--quants", default=DEFAULT_QUANTS,
                        help="comma-separated quantizations to compare "
                             f"(default: {DEFAULT_QUANTS})")
    return parser


def main(argv: list[str]) -> int:
    """Run the report once per quantization; user errors print one line."""
    from app.commands import bench
    from engine.config import QUANT_CHOICES
    from engine.errors import QuickdraftError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quant != "auto":
        parser.error("use --quants to choose the quantizations")
    quants = [q.strip() for q in args.quants.split(",") if q.strip()]
    bad = [q for q in quants if q not in QUANT_CHOICES]
    if not quants or bad:
        parser.error(f"--quants takes a list from {', '.join(QUANT_CHOICES)}")
    out = Path(args.out or DEFAULT_OUT)
    command = shlex.join(["python", "-m", "scripts.bench_gpu", *argv])
    try:
        for quant in quants:
            print(f"== {quant} ==", file=sys.stderr, flush=True)
            variant = argparse.Namespace(**{**vars(args), "quant": quant, "out": str(out / quant)})
            bench.execute(variant, command)
    except QuickdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = out / "summary.md"
    summary.write_text(summarize(out, quants, command), encoding="utf-8")
    print(f"wrote {summary}", file=sys.stderr)
    return 0


def summarize(out: Path, quants: list[str], command: str) -> str:
    """One Markdown page: each quantization's overall and per-category tables."""
    from bench.report import category_table, notes, overall_table

    lines = ["# Quickdraft speed report: quantizations", "", f"Command: `{command}`", ""]
    for quant in quants:
        report = json.loads((out / quant / "report.json").read_text(encoding="utf-8"))
        m, s = report["machine"], report["settings"]
        where = m["gpu"] or m["cpu"]
        lines += [f"## {quant} ({s['model_id']} on {s['device']}, {where}; {s['date']})", "",
                  *overall_table(report), "", "Speedup over hf by category:", "",
                  *category_table(report, "speedup_vs_hf"), "", *notes(report), "",
                  f"Details: [{quant}/report.md]({quant}/report.md)", ""]
    return "\n".join(lines)


def _bootstrap(argv: list[str]) -> None:
    """Re-run inside the pinned .venv (created on first use), as launcher.py does."""
    import launcher  # `python -m` from the repository root puts it on the path

    if launcher.bootstrap_disabled() or launcher.is_running_in(launcher.VENV_DIR):
        return
    try:
        python = launcher.ensure_env()
    except launcher.BootstrapError as exc:
        print(str(exc), file=sys.stderr)
        sys.exit(1)
    os.execv(str(python), [str(python), "-m", "scripts.bench_gpu", *argv])


if __name__ == "__main__":
    _bootstrap(sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    sys.exit(main(sys.argv[1:]))
