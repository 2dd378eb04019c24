"""The loaded weights' quantization in words people read: a short name for the chat's header,
and on the Models tab what Auto measured to choose it. Step speeds are shown as ratios to
bf16's, timed in alternating rounds when the model was first loaded here (a busy machine
slows every candidate of a round alike, so the ratios hold where the milliseconds do not,
and they are no per-token figure of a reply)."""

from __future__ import annotations

import html

from engine.weights import kernels
from engine.weights.quant_auto import PPL_TOLERANCE, RIGHT_SLACK

NAMES = {"fp32": "32-bit floats (fp32)", "bf16": "16-bit floats (bf16)",
         "int8w": "8-bit weights (int8w)", "int4": "4-bit weights (int4)",
         "nf4": "4-bit NF4 (bitsandbytes)", "int8": "8-bit (bitsandbytes)",
         "gguf": "the GGUF file's own blocks (gguf)"}


def name(quant: str) -> str:
    return NAMES.get(quant, quant)


def kernel_words(quant: str, device: str) -> str:
    """Which kernels multiply `quant` weights on `device` here."""
    if quant in ("int4", "int8w", "gguf"):
        if device == "cuda":
            return "PyTorch's CUDA kernels"
        return "PyTorch's kernels" if kernels.problem else "Quickdraft's own CPU kernels"
    if quant in ("nf4", "int8"):
        return "bitsandbytes"
    return "PyTorch"


def quant_short(lm) -> str:
    """For the chat's header: "8-bit weights (int8w) on cpu, chosen by Auto"."""
    how = "chosen by Auto" if lm.spec.quant == "auto" else "as asked"
    return f"{name(lm.quant)} on {lm.device.type}, {how}"


def quant_record(lm) -> str:
    """For the Models tab: the weights, their kernels and, when Auto chose them, what it
    measured (each candidate's answers, perplexity and step speed, behind a click)."""
    head = f"{name(lm.quant)} on {lm.device.type} ({kernel_words(lm.quant, lm.device.type)})"
    if lm.spec.quant != "auto":
        return f"{head}, as asked."
    choice = lm.quant_choice
    if choice is None or not choice.records:
        why = lm.quant_reason.removeprefix(f"{lm.quant}: ")
        return f"{head}, chosen by Auto" + (f": {why}." if why else ".")
    lines = [_candidate(q, r, choice, lm.quant) for q, r in choice.records.items()]
    return (f"{head}, chosen by Auto: the smallest weights that answered {choice.questions} "
            "held-out questions about as well as bf16 and ran clearly faster here. Measured "
            "once, the first time this model loaded on this machine (Measure Auto's choice "
            "again repeats it).\n\n<details><summary>What each choice did</summary>\n\n"
            + "\n".join(lines) + "\n\nSpeed: one decode step, against bf16's, timed in "
            "alternating rounds (a busy machine slows all alike). Perplexity: how surprised "
            "the weights are by a held-out text, lower is better.\n\n</details>")


def _candidate(quant: str, r: dict, choice, chosen: str) -> str:
    bf16 = choice.records.get("bf16", {})
    parts = [f"{r['right']} of {choice.questions} questions right",
             f"{r['same']} answers the same as bf16's", f"perplexity {r['perplexity']:.2f}"]
    if r.get("ms") and bf16.get("ms"):
        parts.append(f"step {bf16['ms'] / r['ms']:.2f}× as fast as bf16's")
    if quant == chosen:
        verdict = "chosen"
    elif not r["admitted"]:
        verdict = "not used: " + _refused(r, bf16)
    else:
        verdict = "answers as well, but not clearly faster than the one chosen"
    return f"- **{html.escape(name(quant))}**: {', '.join(parts)}. {verdict.capitalize()}."


def _refused(r: dict, bf16: dict) -> str:
    """Why a candidate was not admitted (quant_auto.admitted's rule)."""
    if bf16 and r["right"] < bf16["right"] - RIGHT_SLACK:
        return (f"more than {RIGHT_SLACK} question{'s' * (RIGHT_SLACK > 1)} fewer right "
                f"than bf16 ({bf16['right']})")
    if bf16 and r["perplexity"] > bf16["perplexity"] * (1 + PPL_TOLERANCE):
        return f"perplexity over {100 * PPL_TOLERANCE:.0f}% above bf16's"
    return "its answers fell short of bf16's"
