"""`--quant auto` on a CPU: the fastest weight choice whose perplexity passes the quality
gate, measured once per machine, model and torch version, and remembered.

The gate compares perplexity on a held-out text (assets/heldout_text.txt) with the loaded
weights in bf16: for a model converted from a GGUF file those are the file's own weights, so
passing means "no worse than the GGUF file the user would otherwise run", up to
PPL_TOLERANCE (requantizing a Q4 file's weights is near-lossless but not exact).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import devices, quant
from engine.paths import atomic_write, cache_dir

HELDOUT = Path(__file__).resolve().parent.parent / "assets" / "heldout_text.txt"
PPL_TOLERANCE = 0.02  # a low-bit choice may lose at most 2% perplexity against bf16
CANDIDATES = ("int4", "int8w")  # tried against bf16, fastest first if they pass
HELDOUT_TOKENS = 512  # tokens of the held-out text scored (one forward)
# In the cache folder (a re-creatable measurement, kept across runs and tests): {key: Choice}
FILE = "quant_choices.json"


@dataclass(frozen=True)
class Choice:
    """What auto picked and the figures it picked by."""

    quant: str  # the resolved quantization: int4 | int8w | bf16
    reason: str  # one line for the Models tab
    perplexity: dict  # {quant: perplexity on the held-out text}, fp32 and bf16 included
    plain_ms: dict  # {quant: ms of one plain decode step}
    agreement: dict  # {quant: share of held-out positions whose argmax equals bf16's}


def machine_key(fingerprint: str) -> str:
    """The model, the torch build and the CPU a choice was measured on."""
    threads = torch.get_num_threads()
    return f"{fingerprint}|torch {torch.__version__}|{devices.cpu_name()}|{threads}t"


def remembered(key: str) -> Choice | None:
    try:
        entry = json.loads((cache_dir() / FILE).read_text()).get(key)
    except (OSError, ValueError):
        return None
    try:
        return Choice(**entry) if entry else None
    except TypeError:  # written by another version: measure again
        return None


def remember(key: str, choice: Choice) -> None:
    path = cache_dir() / FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table[key] = asdict(choice)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(table, indent=1)))


def heldout_ids(tokenizer, limit: int = HELDOUT_TOKENS) -> torch.Tensor:
    ids = tokenizer(HELDOUT.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
    return ids[:, :limit]


def score(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(perplexity of ids under model, argmax next tokens (S - 1,))."""
    with torch.inference_mode():
        logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[0, :-1]
    logits = logits.float().cpu()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(nll.item()), logits.argmax(-1)


def decide(perplexity: dict, plain_ms: dict, tolerance: float = PPL_TOLERANCE
           ) -> tuple[str, str]:
    """(choice, reason): the fastest of bf16 and the candidates whose perplexity is within
    `tolerance` of bf16's. Pure: the inputs are measured figures."""
    gate = perplexity["bf16"] * (1 + tolerance)
    passing = [q for q in plain_ms if q == "bf16" or perplexity[q] <= gate]
    best = min(passing, key=plain_ms.get)
    failed = [q for q in plain_ms if q not in passing]
    reason = (f"{best}: fastest plain step ({plain_ms[best]:.1f} ms, bf16 "
              f"{plain_ms['bf16']:.1f} ms) with perplexity {perplexity[best]:.2f} "
              f"(bf16 {perplexity['bf16']:.2f}, gate +{tolerance:.0%})")
    if failed:
        reason += "; failed the gate: " + ", ".join(f"{q} {perplexity[q]:.2f}" for q in failed)
    return best, reason


def measure(model, tokenizer, wrap, report=None) -> Choice:
    """Measure bf16, fp32 (quality only) and each candidate on a bf16 `model` (left
    unchanged); `wrap(model, quant)` makes a LoadedModel to time plain steps with."""
    from engine.drafters.payoff import plain_step_seconds

    report = report or (lambda _message: None)
    ids = heldout_ids(tokenizer)
    perplexity, plain_ms, agreement = {}, {}, {}
    perplexity["bf16"], ref = score(model, ids)
    perplexity["fp32"], _ = score(copy.deepcopy(model).float(), ids)
    plain_ms["bf16"] = plain_step_seconds(wrap(model, "bf16")) * 1e3
    agreement["bf16"] = 1.0
    for kind in CANDIDATES:
        report(f"measuring {kind} weights on this CPU (first time only)")
        low = quant.quantize_model(copy.deepcopy(model), kind)
        perplexity[kind], top = score(low, ids)
        agreement[kind] = float((top == ref).float().mean())
        plain_ms[kind] = plain_step_seconds(wrap(low, kind)) * 1e3
        del low
    best, reason = decide(perplexity, plain_ms)
    return Choice(best, reason, perplexity, plain_ms, agreement)
