#!/usr/bin/env python3
"""Where a Kangaroo round spends its time on this machine, with the trained adapter.

    .venv/bin/python scripts/profile_kangaroo.py [--quant bf16] [--prompts N] [--tokens N]

Decodes bench prompts greedily with the stored Kangaroo accelerator while timing its parts
(shallow layers, adapter, draft head, deep verification, acceptance and cache work), then
times the two design levers in isolation: the adapter's feed-forward block and the reduced
draft vocabulary. Prints one JSON object. Run it alone: timings on a shared CPU mean little.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import generate as loop  # noqa: E402
from engine.chat import conversation, encode  # noqa: E402
from engine.config import ModelSpec, SamplingParams  # noqa: E402
from engine.drafters.kangaroo import Adapter, KangarooDrafter  # noqa: E402
from engine.drafters.kangaroo_adapter import adapt, draft_head  # noqa: E402
from engine.drafters.registry import load_drafter  # noqa: E402
from engine.loading import load_model  # noqa: E402


class Timers:
    """Wall time per part, summed over a generation."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, obj, name: str, part: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            begin = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - begin
            self.calls[part] += 1
            return out

        setattr(obj, name, timed)


def profile_rounds(lm, drafter: KangarooDrafter, prompts: list[list[int]], tokens: int) -> dict:
    timers = Timers()
    for name, part in (("_shallow", "shallow layers (1 token)"), ("_adapt", "adapter"),
                       ("_choose", "draft head + choice"), ("commit", "cache work")):
        timers.wrap(drafter, name, part)
    score = drafter.score

    def timed_score(state, draft):  # deep layers; its last-token shallow call is timed apart
        begin = time.perf_counter()
        out = score(state, draft)
        timers.seconds["deep verification (+ last shallow)"] += time.perf_counter() - begin
        return out

    drafter.score = timed_score
    accept = loop.accept

    def timed_accept(*args):
        begin = time.perf_counter()
        out = accept(*args)
        timers.seconds["acceptance"] += time.perf_counter() - begin
        return out

    loop.accept = timed_accept
    params = SamplingParams(max_new_tokens=tokens)
    steps = generated = 0
    begin = time.perf_counter()
    for ids in prompts:
        _t, out, stats = loop.run(lm, ids, params, drafter)
        steps += stats.steps
        generated += stats.tokens
    total = time.perf_counter() - begin
    loop.accept = accept
    per_round = {k: round(1000 * v / steps, 2) for k, v in timers.seconds.items()}
    return {"rounds": steps, "tokens": generated, "tokens_per_round": round(generated / steps, 3),
            "ms_per_round": round(1000 * total / steps, 2), "parts_ms_per_round": per_round,
            "calls_per_round": {k: round(v / steps, 2) for k, v in timers.calls.items()}}


def median_ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return round(1000 * statistics.median(times), 3)


def lever_timings(lm, drafter: KangarooDrafter) -> dict:
    """One draft step's adapter (a decoder layer), and the head at full vs reduced size."""
    model = lm.model
    x = torch.randn(1, 1, model.config.hidden_size, dtype=lm.dtype)
    out = {}
    with torch.inference_mode():
        adapter = Adapter(model).to(lm.dtype).eval()
        out["adapter_ms"] = median_ms(lambda: adapt(model, adapter, x, 0))
        full = draft_head(model, None).to(lm.dtype)
        h = x[0]
        out[f"head_ms full ({full.shape[0]} rows)"] = median_ms(
            lambda: torch.nn.functional.linear(h, full).float().softmax(-1))
        if drafter.vocab is not None:
            small = drafter.head
            out[f"head_ms reduced ({small.shape[0]} rows)"] = median_ms(
                lambda: torch.nn.functional.linear(h, small).float().softmax(-1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="auto")
    parser.add_argument("--prompts", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    lm = load_model(ModelSpec(quant=args.quant))
    drafter = load_drafter(lm, "kangaroo")
    bench = ROOT / "assets" / "bench_prompts.jsonl"
    records = [json.loads(line) for line in bench.read_text().splitlines()]
    picked = records[::max(1, len(records) // args.prompts)][:args.prompts]
    prompts = [encode(lm.tokenizer, conversation(r["prompt"], r.get("history"))) for r in picked]
    plain_ms = None
    with torch.inference_mode():
        params = SamplingParams(max_new_tokens=args.tokens)
        begin, count = time.perf_counter(), 0
        for ids in prompts:
            count += loop.run(lm, ids, params)[2].steps
        plain_ms = round(1000 * (time.perf_counter() - begin) / count, 2)
    report = {"quant": lm.quant, "settings": drafter.settings.to_json(),
              "plain_ms_per_step": plain_ms,
              "round": profile_rounds(lm, drafter, prompts, args.tokens),
              "levers": lever_timings(lm, drafter)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
