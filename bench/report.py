"""Measurements -> figures per method and category -> report.json and report.md.

Every figure is computed here from the runner's measurements, nothing is estimated:
tokens/s is generated tokens over the call's wall time (median over prompts); a speedup is
the median over prompts of the per-prompt tokens/s ratio to the reference method on the
same prompt; acceptance figures pool every step of every prompt.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from bench import llamabench
from bench.leaveout import WITH_STORE
from bench.methods import BASELINE, OVERALL
from bench.runner import Measurement
from engine import devices
from engine.decode import neartie
from engine.decode.neartie import Divergence
from engine.decode.stats import GenerationStats

LOOKUP = "hf-lookup"  # the model-free speculative peer accelerators are also compared with
LLAMACPP = "llama.cpp"  # the native peer every method's tok/s is also set against


def summarize(results: list[Measurement], greedy: bool,
              verdicts: dict[tuple[str, int], Divergence] | None = None) -> dict[str, dict]:
    """{method: {figures..., "by_category": {category: {figures...}}}}, in run order.
    `verdicts`: (method, prompt index) -> the measured first difference of a greedy reply
    that differs from the baseline's (see divergences)."""
    ref = _by_prompt(results, BASELINE)
    lookup = _by_prompt(results, LOOKUP)
    methods = list(dict.fromkeys(m.method for m in results))
    categories = list(dict.fromkeys(m.category for m in results))
    verdicts = verdicts or {}
    summary = {}
    for name in methods:
        rows = [m for m in results if m.method == name]
        entry = figures(rows, ref, lookup, greedy, verdicts)
        entry["by_category"] = {
            cat: figures([m for m in rows if m.category == cat], ref, lookup, greedy, verdicts)
            for cat in categories
        }
        summary[name] = entry
    return summary


def divergences(lm, prompt_ids: list[list[int]],
                results: list[Measurement]) -> dict[tuple[str, int], Divergence]:
    """Where each greedy reply that differs from the baseline's first differs, and whether
    the plain model's call there is a near-tie the dtype's rounding can flip (one forward
    per mismatched reply)."""
    ref = _by_prompt(results, BASELINE)
    out = {}
    for m in results:
        baseline = ref[m.prompt_index].ids
        if m.method != BASELINE and m.ids != baseline:
            out[m.method, m.prompt_index] = neartie.measure(
                lm, prompt_ids[m.prompt_index], baseline, m.ids)
    return out


def figures(rows: list[Measurement], ref: dict[int, Measurement],
            lookup: dict[int, Measurement], greedy: bool,
            verdicts: dict[tuple[str, int], Divergence]) -> dict:
    """The report's figures for one method over `rows` (one measurement per prompt)."""
    known = all(m.accepted is not None for m in rows)
    pooled = GenerationStats(accepted=[a for m in rows for a in m.accepted]) if known else None
    matches = [_prefix(m.ids, ref[m.prompt_index].ids) for m in rows] if greedy else []
    return {
        "prompts": len(rows),
        "tokens": sum(len(m.ids) for m in rows),
        **_speeds(rows, ref),
        "speedup_vs_hf_lookup": _median_ratio(rows, lookup) if lookup else None,
        "mean_accepted": _r(pooled.mean_accepted) if pooled else None,
        "ctar": [_r(c) for c in pooled.ctar()] if pooled else None,
        "accepted_histogram": pooled.accepted_histogram() if pooled else None,
        "ttft_s": _r(statistics.median(m.ttft_s for m in rows)),
        "peak_mem_mb": _r(max(m.peak_mem_mb for m in rows)),
        "peak_mem_delta_mb": _r(max(m.peak_mem_delta_mb for m in rows)),
        "greedy_match_rate": _r(sum(f == 1.0 for f in matches) / len(rows)) if greedy else None,
        "prefix_match": _r(statistics.fmean(matches)) if greedy else None,
        "mismatched_prompts": ([m.prompt_index for m, f in zip(rows, matches, strict=True)
                                if f < 1.0] if greedy else []),
        # per mismatched prompt: first differing position, logit gap, rounding, near_tie
        "mismatches": [{"prompt": m.prompt_index, **verdicts[m.method, m.prompt_index].to_json()}
                       for m in rows if (m.method, m.prompt_index) in verdicts],
        "same_text": same_text(rows, ref) if greedy else None,
    }


def same_text(rows: list[Measurement], ref: dict[int, Measurement]) -> dict:
    """Speed over only the prompts whose text equals the baseline's: methods compared on
    identical work (in bf16 texts part at near-ties on many prompts, and one lucky long
    copy can move a category's median)."""
    same = [m for m in rows if m.ids == ref[m.prompt_index].ids]
    if not same:
        return {"prompts": 0, "tokens_per_s": None, "speedup_vs_hf": None}
    return {"prompts": len(same), **_speeds(same, ref)}


def _speeds(rows: list[Measurement], ref: dict[int, Measurement]) -> dict:
    """Median tokens/s, and the speedup over the baseline, pooled and pass by pass."""
    return {"tokens_per_s": _r(statistics.median(m.tokens_per_s for m in rows)),
            "speedup_vs_hf": _median_ratio(rows, ref),
            "speedup_vs_hf_passes": _pass_ratios(rows, ref)}


def _by_prompt(results: list[Measurement], method: str) -> dict[int, Measurement]:
    return {m.prompt_index: m for m in results if m.method == method}


def _median_ratio(rows: list[Measurement], ref: dict[int, Measurement]) -> float:
    return _r(statistics.median(m.tokens_per_s / ref[m.prompt_index].tokens_per_s for m in rows))


def _pass_ratios(rows: list[Measurement], ref: dict[int, Measurement]) -> list[float] | None:
    """The speedup each pass measured on its own (None after one pass): how far the figure
    moves from pass to pass is the noise any difference between methods must beat."""
    if not rows or not rows[0].passes or not ref[rows[0].prompt_index].passes:
        return None
    count = len(rows[0].passes)
    return [_r(statistics.median(m.passes[i] / ref[m.prompt_index].passes[i] for m in rows))
            for i in range(count)]


def _prefix(ids: list[int], ref: list[int]) -> float:
    """Share of the longer sequence that both share from the start (1.0 = identical)."""
    longest = max(len(ids), len(ref))
    if longest == 0:
        return 1.0
    same = 0
    for a, b in zip(ids, ref, strict=False):  # lengths may differ
        if a != b:
            break
        same += 1
    return same / longest


def _r(x: float) -> float:
    return round(float(x), 4)


def machine_info(device: torch.device) -> dict:
    """What the figures were measured on."""
    import transformers

    return {
        "cpu": devices.cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_avg_start": _load_avg(),
    }


def _load_avg() -> list[float] | None:
    """1, 5 and 15-minute load averages: a busy machine makes the figures noisier."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def build_report(machine: dict, settings: dict, results: list[Measurement],
                 skipped: dict[str, str],
                 verdicts: dict[tuple[str, int], Divergence] | None = None) -> dict:
    """The report.json object (design.md §2's keys plus skipped methods and raw data).
    `verdicts`: the measured greedy mismatches (divergences)."""
    greedy = settings["temperature"] == 0
    return {
        "machine": {**machine, "load_avg_end": _load_avg()},
        "settings": settings,
        "methods": summarize(results, greedy, verdicts),
        "skipped": skipped,
        "measurements": [m.to_json() for m in results],
    }


def write_report(report: dict, out: Path) -> list[Path]:
    """report.json, report.md and the plots into `out`; returns the files written."""
    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    images = plots.write_plots(report, out)
    (out / "report.md").write_text(to_markdown(report, [p.name for p in images]),
                                   encoding="utf-8")
    return [out / "report.json", out / "report.md", *images]


def to_markdown(report: dict, images: list[str] = ()) -> str:
    """The report as Markdown: header, overall table, per-category speedups, notes."""
    m, s = report["machine"], report["settings"]
    where = m["gpu"] or f"{m['cpu']}, {m['cores']} cores, {m['threads']} torch threads"
    mode = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"
    lines = [
        "# Quickdraft speed report", "",
        f"- Date: {s['date']}",
        f"- Machine: {where}; torch {m['torch']}, transformers {m['transformers']}, "
        f"device {m['device']}; load average {m['load_avg_start']} at start, "
        f"{m['load_avg_end']} at end",
        f"- Model: {s['model_id']}, {s['quant']} on {s['device']} "
        f"(loaded in {s['load_s']:.2f} s)",
        f"- Settings: {s['prompts']} prompts ({', '.join(s['categories'])}), "
        f"{s['max_new_tokens']} max new tokens, {mode}, seed {s['seed']}; warm-up, then "
        "methods interleaved prompt by prompt" + _passes(s.get("passes", 1)),
        f"- Peak memory: {s['memory']}",
        f"- Command: `{s['command']}`", "",
        "## Overall", "", *overall_table(report), "",
        f"## Speedup over {BASELINE} by category", "",
        *category_table(report, "speedup_vs_hf"), "",
    ]
    if any(v.get("speedup_vs_hf_lookup") is not None for v in report["methods"].values()):
        lines += [f"## Speedup over {LOOKUP} by category", "",
                  *category_table(report, "speedup_vs_hf_lookup"), ""]
    if s["temperature"] == 0:
        lines += [f"## Speedup over {BASELINE} on the same text by category", "",
                  f"Only the prompts where a method's text equals {BASELINE}'s (their number "
                  "in brackets).", "", *category_table(report, _same_text_cell), ""]
    if s.get("step_costs"):
        lines += ["## Cost of an n-token step", "",
                  "Verifying n tokens at once on these weights, in plain (one-token) steps; "
                  "drafting pays only where this stays near 1.", "",
                  *step_cost_table(s["quant"], s["step_costs"]), ""]
    lines += ["## Notes", "", *notes(report), ""]
    lines += [f"![{Path(name).stem}]({name})" for name in images]
    return "\n".join(lines).rstrip() + "\n"


def _passes(n: int) -> str:
    return (f"; {n} passes, each with freshly built methods, a prompt's tokens/s the median "
            "over them (±: half the range of a speedup measured pass by pass)" if n > 1 else "")


def overall_table(report: dict) -> list[str]:
    """Markdown rows: one per method, the pooled figures; with a llama.cpp row, each
    method's tok/s over llama.cpp's."""
    peer = report["methods"].get(LLAMACPP)
    bench = report.get("peers", {}).get("llama-bench")
    columns = [  # (header, the cell from a method's figures)
        ("tok/s", lambda f: f"{f['tokens_per_s']:.1f}"),
        ("speedup vs hf", lambda f: f"{f['speedup_vs_hf']:.2f}x"),
        ("vs hf-lookup", lambda f: _fmt(f["speedup_vs_hf_lookup"], "x")),
        *([("vs llama-bench", lambda f: _fmt(vs_llamacpp(f, bench), "x"))] if bench else []),
        *([("vs llama.cpp", lambda f: _fmt(vs_llamacpp(f, peer), "x"))] if peer else []),
        ("tokens/step", lambda f: _fmt(f["mean_accepted"])),
        ("CTAR(1)", lambda f: _fmt(f["ctar"][0]) if f["ctar"] else "n/a"),
        ("TTFT ms", lambda f: f"{f['ttft_s'] * 1000:.0f}"),
        ("peak MB (+ during generation)",
         lambda f: f"{f['peak_mem_mb']:.0f} (+{f['peak_mem_delta_mb']:.0f})"),
        ("greedy match (exact / prefix)",
         lambda f: "n/a (sampling)" if f["greedy_match_rate"] is None else
         f"{f['greedy_match_rate']:.0%} / {f['prefix_match']:.1%}"),
    ]
    return _table(["method", *(header for header, _ in columns)],
                  [[name, *(cell(f) for _, cell in columns)]
                   for name, f in report["methods"].items()])


def vs_llamacpp(f: dict, peer: dict) -> float | None:
    """A method's median tok/s over llama.cpp's (its binding's row, or llama-bench's priced
    on this method's own replies where the bench did; None when llama.cpp produced
    nothing)."""
    own = f.get("llama_bench_tokens_per_s") if "runs" in peer else None
    base = own or peer["tokens_per_s"]
    return f["tokens_per_s"] / base if base else None


def category_table(report: dict, key: str | Callable[[dict], str]) -> list[str]:
    """Markdown rows: method x category for one figure (its key, or a function of a
    method's figures that writes the cell), plus the pooled column."""
    methods = report["methods"]
    categories = list(next(iter(methods.values()))["by_category"])
    cell = key if callable(key) else (
        lambda f: _fmt(f[key], "x") + _spread(f.get(key + "_passes")))
    return _table(["method", *categories, OVERALL],
                  [[name, *(cell(f["by_category"][c]) for c in categories), cell(f)]
                   for name, f in methods.items()])


def step_cost_table(quant: str, step_costs: dict) -> list[str]:
    """Markdown rows: the plain step in ms, then n-token steps in plain steps (from the
    settings' {n: ms of a step verifying n tokens})."""
    ms = {int(n): t for n, t in step_costs.items()}
    sizes = sorted(n for n in ms if n > 1)
    return _table(["weights", "plain step (ms)", *(f"n={n}" for n in sizes)],
                  [[quant, f"{ms[1]:.1f}", *(f"{ms[n] / ms[1]:.2f}" for n in sizes)]],
                  rule="|---|---|" + "---|" * len(sizes))


def _table(header: list[str], rows: list[list[str]], rule: str = "") -> list[str]:
    """Markdown lines: the header, the rule (by default the first column left-aligned and
    the figures right-aligned), then the rows, each a list of cells."""
    lines = ["| " + " | ".join(cells) + " |" for cells in [header, *rows]]
    return [lines[0], rule or "| --- |" + " ---: |" * (len(header) - 1), *lines[1:]]


def _same_text_cell(f: dict) -> str:
    """The same-text speedup and, in brackets, over how many prompts."""
    same = f.get("same_text") or {}
    return (f"{_fmt(same.get('speedup_vs_hf'), 'x')}{_spread(same.get('speedup_vs_hf_passes'))}"
            f" ({same.get('prompts', 0)})")


def _spread(per_pass: list[float] | None) -> str:
    """' ±s': half the range of a figure over the passes (nothing after one pass)."""
    if not per_pass or len(per_pass) < 2:
        return ""
    return f" ±{(max(per_pass) - min(per_pass)) / 2:.2f}"


def notes(report: dict) -> list[str]:
    """Greedy mismatches against hf (never hidden) and methods that did not run."""
    lines = []
    greedy = report["settings"]["temperature"] == 0
    dtype = report["settings"].get("dtype", "")
    for name, f in report["methods"].items():
        if greedy and f["mismatched_prompts"] and name.startswith(LLAMACPP):
            # Its own decoder over the file's own quantized weights: other text is expected.
            lines.append(f"- {name} decodes the GGUF file's own weights, so its text differs "
                         f"from {BASELINE} on {len(f['mismatched_prompts'])} of {f['prompts']} "
                         f"prompts (exact match {f['greedy_match_rate']:.1%}).")
        elif greedy and f["mismatched_prompts"]:
            lines += _mismatch_lines(name, f, dtype)
    if not greedy:
        lines.append("- Sampling: outputs differ by design, so they are not compared token for "
                     "token (run with --temperature 0 for the greedy match).")
    elif not lines:
        lines.append(f"- Every method matched {BASELINE} token for token on every prompt.")
    lines += [f"- {name} did not run: {why}" for name, why in report["skipped"].items()]
    lines += _picks(report["measurements"])
    if bench := report.get("peers", {}).get("llama-bench"):
        lines.append(llamabench.note(bench, BASELINE))
    if store := report["settings"].get("datastore"):
        lines.append(f"- Datastore methods ({', '.join(WITH_STORE)}; compare "
                     f"{', '.join(WITH_STORE.values())}): {store['rule']}.")
    return lines


def _mismatch_lines(name: str, f: dict, dtype: str) -> list[str]:
    """Greedy differences from the baseline: a near-tie within the dtype's rounding is
    named as such; every other one (or one not measured) is a MISMATCH."""
    ties = [d for d in f.get("mismatches", []) if d["near_tie"]]
    tied = {d["prompt"] for d in ties}
    bad = [p for p in f["mismatched_prompts"] if p not in tied]
    where = {d["prompt"]: f" at token {d['position'] + 1} (gap {d['gap']:.3g})"
             for d in f.get("mismatches", [])}
    lines = []
    if bad:
        lines.append(
            f"- MISMATCH: {name} differs from {BASELINE} on {len(bad)} of {f['prompts']} "
            f"prompts beyond {dtype} rounding (exact match {f['greedy_match_rate']:.1%}, mean "
            f"matching prefix {f['prefix_match']:.1%}); prompts "
            + ", ".join(f"{p}{where.get(p, '')}" for p in bad[:12]))
    if ties:
        lines.append(
            f"- {name} differs from {BASELINE} on {len(ties)} of {f['prompts']} prompts by a "
            f"near-tie within {dtype} rounding; prompts "
            + ", ".join(f"{d['prompt']}{where[d['prompt']]}" for d in ties[:12]))
    return lines


def _picks(measurements: list[dict]) -> list[str]:
    """How Auto drafted, per category: the share of its steps of each kind."""
    picks: dict[str, Counter] = {}
    for m in measurements:
        if m.get("used"):
            picks.setdefault(m["category"], Counter()).update(m["used"])
    if not picks:
        return []
    cells = "; ".join(
        f"{cat}: " + ", ".join(f"{name} {100 * n / sum(c.values()):.0f}%"
                               for name, n in c.most_common())
        for cat, c in picks.items())
    return [f"- auto's steps by kind, per category: {cells}"]


def _fmt(x: float | None, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:.2f}{suffix}"
