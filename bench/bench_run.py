"""One benchmark run end to end: encode the prompts, run the method table, build the report."""

from __future__ import annotations

import time
from collections.abc import Callable

from bench import leaveout, llamabench, stepcost
from bench.memory import MemoryProbe
from bench.methods import LOOKUP_TOKENS, Contender
from bench.prompts import BenchPrompt, encode_prompt
from bench.report import build_report, divergences, machine_info
from bench.runner import run_bench
from engine.config import SamplingParams
from engine.progress import Progress, ProgressFn, ignore


def bench_report(
    lm,
    prompts: list[BenchPrompt],
    methods: dict[str, Contender],
    skipped: dict[str, str],
    params: SamplingParams,
    context: dict,
    progress: ProgressFn = ignore,
    passes: int = 1,
    fresh: Callable[[], dict[str, Contender]] | None = None,
    peer: llamabench.LlamaBench | None = None,
) -> dict:
    """Run `methods` (the first is the baseline, `hf`) over `prompts` on `lm` and return the
    report.json object. `context` adds settings the caller knows: the command line, the
    prompt file, the assistant model. `passes` > 1 runs the prompts that many times, each
    pass after the first with `fresh()`'s method table, and keeps the median speeds.
    `peer`: llama.cpp's own benchmark program, run before and after the methods at the
    prompts' mean length."""
    if not prompts:
        raise ValueError("no prompts to run")
    machine = machine_info(lm.device)
    prompt_ids = [encode_prompt(lm, p, params.max_new_tokens) for p in prompts]
    probe = MemoryProbe.for_device(lm.device)
    store = leaveout.described(methods)  # the datastore's leave-one-out replies, if used
    replies = leaveout.plain_replies(lm, prompt_ids, params) if store else {}
    leaveout.ready(methods, replies)
    renew = fresh and (lambda: leaveout.ready(fresh(), replies))
    depth = round(sum(map(len, prompt_ids)) / len(prompt_ids))
    peer_runs = [_peer(peer, depth, params, progress)] if peer else []
    results = run_bench(methods, prompts, prompt_ids, probe, progress, passes, renew)
    peer_runs += [_peer(peer, depth, params, progress)] if peer else []
    settings = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        **context,
        "model_id": lm.model_id,
        "quant": lm.quant,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "device": str(lm.device),
        "load_s": round(lm.load_seconds, 3),
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "seed": params.seed,
        "prompts": len(prompts),
        "categories": list(dict.fromkeys(p.category for p in prompts)),
        "methods": list(methods),
        "lookup_tokens": LOOKUP_TOKENS,
        "warmup": "each method once on the first prompt, not counted",
        "order": "methods interleaved prompt by prompt, order rotated per prompt",
        "passes": passes,
        "memory": probe.describe(),
        **({"datastore": leaveout.described(methods)} if store else {}),
        # ms of a step verifying n tokens on these weights (the speed report's cost table)
        "step_costs": {n: round(t * 1e3, 2) for n, t in stepcost.seconds_by_size(lm).items()},
    }
    verdicts = divergences(lm, prompt_ids, results) if params.temperature == 0 else {}
    report = build_report(machine, settings, results, skipped, verdicts)
    if peer_runs:
        report["peers"] = {"llama-bench": _pooled(peer, peer_runs, _work(report))}
        for name, figures in report["methods"].items():  # each priced on its own replies
            figures["llama_bench_tokens_per_s"] = _priced(peer_runs, _work(report, name))
    return report


def _peer(peer: llamabench.LlamaBench, depth: int, params: SamplingParams,
          progress: ProgressFn) -> dict:
    progress(Progress("llama-bench", 0, 1, f"llama-bench at depth {depth}"))
    return llamabench.measure(peer, depth, params.max_new_tokens)


def _work(report: dict, method: str | None = None) -> list[tuple[int, int]]:
    """(prompt tokens, new tokens) of every reply of `method` (None: the baseline, the
    first method)."""
    method = method or report["settings"]["methods"][0]
    return [(m["prompt_tokens"], m["tokens"]) for m in report["measurements"]
            if m["method"] == method]


def _priced(runs: list[dict], work: list[tuple[int, int]]) -> float:
    """llama.cpp's tokens/s for `work`, the mean over its runs (llamabench.same_work)."""
    return round(sum(llamabench.same_work(r, work) for r in runs) / len(runs), 3)


def _pooled(peer: llamabench.LlamaBench, runs: list[dict],
            work: list[tuple[int, int]]) -> dict:
    """The peer's figures: the mean of its runs before and after the methods, and each.
    tokens_per_s prices the baseline's replies (each method's own row prices its own:
    `llama_bench_tokens_per_s`); reply_tokens_per_s is llama-bench's own reply of the
    longest length."""
    for run in runs:
        run["same_work_tokens_per_s"] = round(llamabench.same_work(run, work), 3)
    mean = lambda key: round(sum(r[key] for r in runs) / len(runs), 3)  # noqa: E731
    return {**llamabench.described(peer), "tokens_per_s": mean("same_work_tokens_per_s"),
            "reply_tokens_per_s": mean("tokens_per_s"),
            "decode_tokens_per_s": mean("decode_tokens_per_s"),
            "ms_per_token": mean("ms_per_token"), "depth": runs[0]["depth"],
            "tokens": runs[0]["tokens"], "replies": len(work),
            "work_tokens": sum(t for _p, t in work), "runs": runs}
