"""How long Lookup's chain after a shorter match (one or two words) should be, per dtype.

    python scripts/lookup_length.py [--quant bf16] [--limit 21] [--passes 2] [--out DIR]

Benches, interleaved prompt by prompt on the bundled model and prompts, Lookup drafting 10
tokens after every match (HF's prompt lookup chain) against Lookup drafting 2 after a
shorter match (10 while a 3-gram match is being copied), and prints the speedups over
`generate()` overall, on the same text and per category. Run it alone, once per dtype:
`engine.drafters.lookup.LONG_CHAIN_COST` is set from what it shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.benchmark.bench import bench_report  # noqa: E402
from engine.benchmark.methods import build_methods, engine_method  # noqa: E402
from engine.benchmark.prompts import DEFAULT_PROMPTS, load_prompts, round_robin  # noqa: E402
from engine.benchmark.report import category_table  # noqa: E402
from engine.config import ModelSpec, SamplingParams  # noqa: E402
from engine.drafters.lookup import LookupDrafter, LookupParams  # noqa: E402
from engine.loading import load_model  # noqa: E402

VARIANTS = {"lookup-10": 10, "lookup-2": 2}  # name -> tokens drafted after a shorter match


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--limit", type=int, default=21)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="folder for report.json")
    args = parser.parse_args()

    lm = load_model(ModelSpec(quant=args.quant))
    params = SamplingParams(max_new_tokens=128)
    prompts = round_robin(load_prompts(DEFAULT_PROMPTS), args.limit)

    def table():
        methods, _ = build_methods(lm, ["hf", "vanilla"], params)
        for name, short in VARIANTS.items():
            drafter = LookupDrafter(LookupParams(short_len=short))
            methods[name] = engine_method(name, lm, params, drafter)
        return methods

    report = bench_report(lm, prompts, table(), {}, params,
                          {"command": " ".join(sys.argv)}, passes=args.passes, fresh=table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
    for name, m in report["methods"].items():
        same = m.get("same_text", {})
        print(f"{name}: {m['speedup_vs_hf']:.2f}x (passes {m.get('speedup_vs_hf_passes')}); "
              f"same text {same.get('speedup_vs_hf')} over {same.get('prompts')} prompts")
    print("\n".join(category_table(report, "speedup_vs_hf")))


if __name__ == "__main__":
    main()
