"""Structured output on a held-out set of JSON schemas (scripts/structured_schemas.json,
kept out of the tests): is every reply valid, and how fast are replies with the grammar's
forced tokens drafted, without them, and unconstrained.

    python -m scripts.structured_bench [--quant auto] [--rounds 2] [--out DIR]

Greedy replies, methods interleaved prompt by prompt (engine/decode/interleave.py): "off" decodes
plainly under the schema's mask, "grammar" drafts the forced tokens, "auto" is Auto with
every source (the grammar's included), "auto-no-grammar" Auto without it, and "free" the
same prompts with no schema (plain decoding). Writes DIR/report.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from engine.config import ModelSpec, SamplingParams
from engine.decode import grammar as grammars
from engine.decode.chat_template import conversation, encode
from engine.decode.drafter import Drafter
from engine.decode.generate import run
from engine.decode.interleave import interleaved
from engine.decode.timing import step_cost
from engine.drafters.auto import auto
from engine.drafters.registry import load_drafter, load_source, sources
from engine.errors import AcceleratorError
from engine.model.loading import load_model

SCHEMAS = Path(__file__).with_name("structured_schemas.json")
METHODS = ("off", "grammar", "auto", "auto-no-grammar", "free")
KEYWORDS = {"type", "properties", "required", "additionalProperties", "enum", "items",
            "minItems", "maxItems", "minimum", "maximum", "minLength", "maxLength"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def problems(value, schema: dict, where: str = "$") -> list[str]:
    """Where `value` breaks `schema` ([] when valid). Covers the keywords the held-out set
    uses and refuses any other, so nothing passes unchecked."""
    unknown = set(schema) - KEYWORDS
    if unknown:
        raise SystemExit(f"the validator does not know {sorted(unknown)} ({where})")
    out = []
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = kind is None or isinstance(value, TYPES[kind]) and not (
            kind != "boolean" and isinstance(value, bool))
    if not ok:
        return [f"{where}: not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not in the enum")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            out.append(f"{where}: {value} out of range")
    if isinstance(value, str | list):
        low = schema.get("minLength", schema.get("minItems", 0))
        high = schema.get("maxLength", schema.get("maxItems", len(value)))
        if not low <= len(value) <= high:
            out.append(f"{where}: length {len(value)} outside [{low}, {high}]")
    if isinstance(value, list):
        for i, item in enumerate(value):
            out += problems(item, schema.get("items", {}), f"{where}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: {k} missing" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            out += [f"{where}: {k} not allowed" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                out += problems(v, props[k], f"{where}.{k}")
    return out


def drafters(lm, names: list[str]) -> dict[str, Drafter | None]:
    """Each method's drafter (None: plain decoding)."""
    every = {}
    for name in sources("auto") if any(n.startswith("auto") for n in names) else ():
        try:
            every[name] = load_source(lm, name)
        except AcceleratorError:
            pass
    cost = step_cost(lm)
    without = {n: d for n, d in every.items() if n != "grammar"}
    built = {"off": None, "grammar": load_drafter(lm, "grammar"),
             "auto": auto(every, cost), "auto-no-grammar": auto(without, cost), "free": None}
    return {n: built[n] for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, from {', '.join(METHODS)} (off always runs)")
    args = parser.parse_args()
    names = ["off", *(m for m in args.methods.split(",") if m in METHODS and m != "off")]
    lm = load_model(ModelSpec(quant=args.quant))
    cases = json.loads(SCHEMAS.read_text())
    built = drafters(lm, names)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    items = [(c, encode(lm.tokenizer, conversation(c["prompt"] + " Answer in JSON.")),
              grammars.json_schema(c["schema"], c["name"])) for c in cases] * args.rounds

    def reply(name, item):
        case, ids, grammar = item
        start = time.perf_counter()
        text, out, stats = run(lm, ids, params, built[name],
                               grammar=None if name == "free" else grammar)
        return {"tokens": stats.tokens, "seconds": time.perf_counter() - start,
                "tokens_per_step": stats.mean_accepted, "ids": out, "text": text,
                "kinds": stats.step_kinds}

    for name in names:  # untimed: no method pays first-call costs
        run(lm, items[0][1], SamplingParams(max_new_tokens=8), built[name], grammar=items[0][2])
    rows = []
    for n, results in interleaved(names, items, reply):
        rows.append((n, results))
        print(f"{n + 1}/{len(items)} {items[n][0]['name']}: " + ", ".join(
            f"{m} {r['tokens'] / r['seconds']:.1f} tok/s" for m, r in results.items()),
            file=sys.stderr, flush=True)
    report = summarize(lm, cases, items, rows, names)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "replies"}, indent=1))


def summarize(lm, cases, items, rows, names: list[str]) -> dict:
    """Validity, greedy agreement, tokens per step and per-method tokens/s (median over
    replies), and the median of per-reply ratios to "off"."""
    invalid, differ, per = [], 0, {m: [] for m in names}
    ratios = {m: [] for m in names}
    steps = {m: [] for m in names}
    replies = []
    constrained = [m for m in names if m != "free"]
    for n, results in rows:
        case = items[n][0]
        for m in names:
            steps[m].append(results[m]["tokens_per_step"])
            r = results[m]
            per[m].append(r["tokens"] / r["seconds"])
            ratios[m].append((r["tokens"] / r["seconds"]) /
                             (results["off"]["tokens"] / results["off"]["seconds"]))
        for m in constrained:
            text = results[m]["text"]
            try:
                found = problems(json.loads(text), case["schema"])
            except ValueError as exc:
                found = [f"not JSON: {exc}"]
            if found:
                invalid.append({"schema": case["name"], "method": m, "problems": found[:3]})
        differ += any(results[m]["ids"] != results["off"]["ids"] for m in constrained)
        replies.append({"schema": case["name"], "text": results["off"]["text"],
                        "tokens": results["off"]["tokens"],
                        "tokens_per_step": {m: round(results[m]["tokens_per_step"], 3)
                                            for m in names},
                        "step_kinds": {m: results[m]["kinds"] for m in names}})
    return {"machine": {"cpu": platform.processor() or platform.machine(),
                        "quant": lm.quant, "step": lm.target.name},
            "schemas": len(cases), "replies_per_method": len(rows),
            "valid": f"{len(rows) * len(constrained) - len(invalid)}/"
                     f"{len(rows) * len(constrained)}", "invalid": invalid,
            "greedy_differs_from_off": differ,
            "tokens_per_s_median": {m: round(statistics.median(v), 2) for m, v in per.items()},
            "speedup_vs_off_median": {m: round(statistics.median(v), 3)
                                      for m, v in ratios.items()},
            "tokens_per_step_mean": {m: round(statistics.mean(v), 3) for m, v in steps.items()},
            "replies": replies}


if __name__ == "__main__":
    main()
