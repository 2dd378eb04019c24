"""Tokens per step of each method with and without the datastore, leave-one-out.

    python scripts/datastore_bench.py [--limit 16] [--quant bf16] [--tokens 128] [--out F]

The bench's own method table and leave-one-out store (engine.benchmark.leaveout): the
datastore for a measured prompt holds the shipped store (the model's answers to the seed
prompts, i.e. the training data) and the plain greedy replies to the *other* measured
prompts, never that prompt's own reply. Greedy decoding, methods interleaved prompt by
prompt; tokens per step does not depend on the machine's load, tokens/s does (indicative).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.benchmark.leaveout import plain_replies, ready  # noqa: E402
from engine.benchmark.methods import build_methods  # noqa: E402
from engine.benchmark.prompts import (  # noqa: E402
    DEFAULT_PROMPTS,
    encode_prompt,
    load_prompts,
    round_robin,
)
from engine.config import ModelSpec, SamplingParams  # noqa: E402
from engine.loading import load_model  # noqa: E402

METHODS = ("lookup", "datastore", "medusa+lookup", "medusa+datastore", "auto-no-datastore",
           "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--measure", type=int, default=None,
                        help="measure only the first N prompts (the stores still hold the "
                             "replies to all the others)")
    parser.add_argument("--replies", type=Path, default=None,
                        help="JSON file of the plain replies: read if it exists, else written")
    args = parser.parse_args()
    lm = load_model(ModelSpec(quant=args.quant))
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens)
    prompts = round_robin(load_prompts(DEFAULT_PROMPTS), args.limit)
    ids = [encode_prompt(lm, p, args.tokens) for p in prompts]
    start = time.perf_counter()
    if args.replies and args.replies.is_file():
        saved = json.loads(args.replies.read_text())
        replies = {tuple(r["prompt"]): r["reply"] for r in saved["replies"]}
        plain_s = saved["seconds_per_token"]
    else:
        replies = plain_replies(lm, ids, params)
        plain_s = (time.perf_counter() - start) / sum(len(r) for r in replies.values())
    if args.replies and not args.replies.is_file():
        args.replies.write_text(json.dumps({"seconds_per_token": plain_s, "replies": [
            {"prompt": list(k), "reply": v} for k, v in replies.items()]}))
    methods, skipped = build_methods(lm, args.methods.split(","), params)
    ready(methods, replies)
    rows: dict[str, list[dict]] = {}
    measured = list(zip(prompts, ids, strict=True))[:args.measure]
    for i, (prompt, p_ids) in enumerate(measured):
        for name, method in methods.items():
            if method.held_out is not None:
                method.held_out.hold_out(p_ids)
            begin = time.perf_counter()
            out = method.generate(p_ids)
            seconds = time.perf_counter() - begin
            rows.setdefault(name, []).append({
                "category": prompt.category,
                "tokens_per_step": statistics.mean(a + 1 for a in out.accepted),
                "speed_vs_plain": plain_s * len(out.ids) / seconds,
                "same": out.ids == replies[tuple(p_ids)], "used": out.used})
        print(i, prompt.category, {k: round(v[-1]["tokens_per_step"], 2)
                                   for k, v in rows.items()}, flush=True)
    report = {name: summary(r) for name, r in rows.items()}
    held = next(m.held_out for m in methods.values() if m.held_out is not None)
    report["_settings"] = {"prompts": len(measured), "replies_in_stores": len(prompts) - 1,
                           "quant": args.quant, "tokens": args.tokens,
                           "skipped": skipped, **held.describe()}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def summary(rows: list[dict]) -> dict:
    cats = sorted({r["category"] for r in rows})

    def mean(rs, key="tokens_per_step"):
        return round(statistics.mean(r[key] for r in rs), 3)

    return {"tokens_per_step": mean(rows),
            "speed_vs_plain_indicative": mean(rows, "speed_vs_plain"),
            "greedy_match_rate": round(sum(r["same"] for r in rows) / len(rows), 3),
            "by_category": {c: mean([r for r in rows if r["category"] == c]) for c in cats}}


if __name__ == "__main__":
    main()
