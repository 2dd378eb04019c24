"""`--quant auto` on a CPU: the smallest weights that answer as well as bf16 and are clearly
faster, measured once per machine, model, torch version and thread count, and remembered.

Quality is judged on replies, not only on a text's perplexity: each candidate answers a
held-out set of short questions with checkable answers (assets/heldout_questions.jsonl,
greedy) and is admitted when it answers at least as many right as bf16 minus one and its
perplexity on a held-out text (assets/heldout_text.txt) is within PPL_TOLERANCE of bf16's.
For a model converted from a GGUF file bf16 holds the file's own weights, so admitted means
"no worse than the file the user would otherwise run".

Speed is judged on ratios, never on one clock reading: the admitted candidates are timed
in interleaved rounds (each round times every candidate, in a rotating order), and a
smaller candidate replaces a larger one only if its plain step is FASTER times faster in the
median round. A busy machine slows all candidates of a round alike, so the same machine
picks the same weights idle and under load; rounds go on until every comparison is clear.
"""

from __future__ import annotations

import copy
import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import devices, kernels, quant
from engine.paths import atomic_write, cache_dir
from engine.timing import StepTimer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
HELDOUT = ASSETS / "heldout_text.txt"
QUESTIONS = ASSETS / "heldout_questions.jsonl"
PPL_TOLERANCE = 0.02  # an admitted choice loses at most 2% perplexity against bf16
RIGHT_SLACK = 1  # ... and answers at most one question fewer right than bf16
CANDIDATES = ("fp32", "bf16", "int8w", "int4")  # largest weights first
FASTER = 1.10  # a smaller choice must be this much faster than the larger one it replaces
MIN_ROUNDS, MAX_ROUNDS = 5, 15
HELDOUT_TOKENS = 512  # tokens of the held-out text scored (one forward)
REPLY_TOKENS = 32  # greedy tokens per question
FILE = "quant_choices.json"  # in the cache folder: {machine key: Choice}
VERSION = 2  # bumped when what a choice means changes: older records are measured again


@dataclass(frozen=True)
class Record:
    """What one candidate did."""

    right: int  # questions answered right
    same: int  # replies equal to bf16's
    perplexity: float  # on the held-out text
    ms: float  # median plain step over the rounds (0 when not timed)
    admitted: bool


@dataclass(frozen=True)
class Choice:
    """What auto picked and the figures it picked by."""

    quant: str  # fp32 | bf16 | int8w | int4
    reason: str  # one line: why this one
    questions: int  # how many questions the replies were checked on
    records: dict  # {quant: Record as a dict}
    version: int = VERSION

    def line(self) -> str:
        """The record in one line (Models tab, chat --json)."""
        parts = []
        for name, r in self.records.items():
            gate = "" if r["admitted"] else " (not admitted)"
            speed = f", {r['ms']:.1f} ms/step" if r["ms"] else ""
            parts.append(f"{name} {r['right']}/{self.questions} right, {r['same']} as bf16, "
                         f"ppl {r['perplexity']:.2f}{speed}{gate}")
        return f"auto picked {self.quant}: " + "; ".join(parts)


def machine_key(fingerprint: str) -> str:
    """The model, the torch build, the CPU, the thread count and the int8 kernel (its
    arithmetic differs from PyTorch's) a choice was measured on."""
    threads = torch.get_num_threads()
    kernel = "own int8 kernel" if kernels.available() else "torch kernels"
    return f"{fingerprint}|torch {torch.__version__}|{devices.cpu_name()}|{threads}t|{kernel}"


def remembered(key: str) -> Choice | None:
    try:
        entry = json.loads((cache_dir() / FILE).read_text()).get(key)
        choice = Choice(**entry) if entry else None
    except (OSError, ValueError, TypeError, AttributeError):  # absent, corrupt, older
        return None
    return choice if choice and choice.version == VERSION else None


def remember(key: str, choice: Choice) -> None:
    path = cache_dir() / FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table[key] = asdict(choice)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(table, indent=1)))


# --- quality ---------------------------------------------------------------------------


def questions() -> list[dict]:
    lines = QUESTIONS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def is_right(reply: str, answers: list[str]) -> bool:
    """Some accepted answer appears in the reply as a word of its own ("4" not in "14")."""
    text = reply.lower()
    return any(re.search(rf"(?<![a-z0-9]){re.escape(a.lower())}(?![a-z0-9])", text)
               for a in answers)


def prompts_that_fit(tokenizer, asked: list[dict], window: int) -> list[tuple[list[int], list]]:
    """(prompt ids, answers) of the questions whose prompt and reply fit the model's window."""
    from engine.chat_template import conversation, encode

    fitting = []
    for q in asked:
        ids = encode(tokenizer, conversation(q["prompt"]))
        if len(ids) + REPLY_TOKENS <= window:
            fitting.append((ids, q["answers"]))
    return fitting


def replies(model, tokenizer, prompts: list[list[int]], eos: set[int]) -> list[list[int]]:
    """Greedy replies (token ids, REPLY_TOKENS at most, cut at any of the `eos` tokens) to
    each prompt, in one left-padded batch: every candidate answers the same batch, so their
    replies compare."""
    if not prompts:
        return []
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=REPLY_TOKENS, do_sample=False, pad_token_id=pad,
                             temperature=None, top_p=None, top_k=None)
    answers = []
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:end])
    return answers


def heldout_ids(tokenizer, limit: int = HELDOUT_TOKENS) -> torch.Tensor:
    ids = tokenizer(HELDOUT.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
    return ids[:, :limit]


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits.float().cpu(), ids[0, 1:])
    return math.exp(nll.item())


# --- the choice (pure) -------------------------------------------------------------------


def admitted(right: dict, ppl: dict, tolerance: float = PPL_TOLERANCE) -> list[str]:
    """The candidates (largest first) that answer as well as bf16: right answers at least
    bf16's minus RIGHT_SLACK, perplexity within `tolerance`. fp32 and bf16 always are."""
    return [q for q in right if q in ("fp32", "bf16") or
            (right[q] >= right["bf16"] - RIGHT_SLACK and ppl[q] <= ppl["bf16"] * (1 + tolerance))]


def compare(rounds: list[dict], larger: str, smaller: str) -> tuple[float, bool]:
    """(median ratio of larger's to smaller's step time, whether the rounds settle which
    side of FASTER it lies on: the middle half of the ratios all on one side of it; a round
    or two disturbed by something else running do not unsettle it)."""
    ratios = sorted(r[larger] / r[smaller] for r in rounds)
    median = statistics.median(ratios)
    if len(ratios) < 4:
        return median, all((x >= FASTER) == (median >= FASTER) for x in ratios)
    low, _mid, high = statistics.quantiles(ratios, n=4)
    return median, low >= FASTER or high < FASTER


def pick(order: list[str], rounds: list[dict]) -> tuple[str, bool, list[str]]:
    """(choice, whether every comparison made is clear, one phrase per comparison): from the
    largest admitted candidate down, a smaller one replaces the choice so far when its step
    is clearly FASTER times faster in the median round; where the rounds do not settle it,
    the larger weights stay (the measuring goes on while `clear` is False)."""
    best, clear, said = order[0], True, []
    for smaller in order[1:]:
        ratio, sure = compare(rounds, best, smaller)
        clear = clear and sure
        verdict = ("faster" if ratio >= FASTER else "not enough faster") if sure else "unclear"
        said.append(f"{smaller} {ratio:.2f}x {best}: {verdict}")
        if sure and ratio >= FASTER:
            best = smaller
    return best, clear, said


# --- measuring ---------------------------------------------------------------------------


def measure(model, tokenizer, wrap: Callable, window: int, eos: tuple[int, ...],
            report=None) -> Choice:
    """Measure every candidate made from a bf16 `model` (left unchanged); `wrap(model,
    quant)` makes a LoadedModel to time plain steps with; `window`: the model's context;
    `eos`: the tokens that end a reply (engine.loading.eos_ids)."""
    report = report or (lambda _message: None)
    fitting = prompts_that_fit(tokenizer, questions(), window)
    prompts = [ids for ids, _answers in fitting]
    ids = heldout_ids(tokenizer, min(HELDOUT_TOKENS, window))
    built, right, same, ppl = {}, {}, {}, {}
    reference = None
    for name in CANDIDATES:
        if not _room_for(model, name):
            report(f"skipping {name} weights: a copy would not fit in memory beside the model")
            continue
        report(f"checking {name} weights' answers on {len(prompts)} questions (first time)")
        built[name] = _weights(model, name)
        answered = replies(built[name], tokenizer, prompts, set(eos))
        reference = answered if name == "bf16" else reference
        right[name] = sum(is_right(tokenizer.decode(a), answers)
                          for a, (_ids, answers) in zip(answered, fitting, strict=True))
        same[name] = answered
        ppl[name] = perplexity(built[name], ids)
    same = {name: sum(a == b for a, b in zip(got, reference, strict=True))
            for name, got in same.items()}
    order = admitted(right, ppl)
    measured = list(built)
    built = {name: built[name] for name in order}  # refused copies go before timing
    steps = {name: StepTimer(wrap(built[name], name)) for name in order}
    rounds = []
    while len(rounds) < MAX_ROUNDS:
        report(f"timing {', '.join(order)} in turn (round {len(rounds) + 1})")
        names = order[len(rounds) % len(order):] + order[:len(rounds) % len(order)]
        rounds.append({name: steps[name].seconds() for name in names})
        best, clear, said = pick(order, rounds)
        if clear and len(rounds) >= MIN_ROUNDS:
            break
    records = {name: asdict(Record(
        right[name], same[name], round(ppl[name], 3),
        round(statistics.median(r[name] for r in rounds) * 1e3, 2) if name in order else 0.0,
        name in order)) for name in measured}
    reason = (f"{best}: the smallest weights answering as well as bf16 that are clearly "
              f"faster ({'; '.join(said)}; {len(rounds)} rounds)")
    return Choice(best, reason, len(prompts), records)


# Bytes per parameter a candidate's copy takes beside the bf16 model (codes, scales, head).
COPY_BYTES = {"fp32": 4.0, "bf16": 0.0, "int8w": 1.1, "int4": 0.8}


def _room_for(model, name: str) -> bool:
    """Whether `name`'s copy fits in half the memory available now (all admitted copies
    stay loaded while they are timed in turn)."""
    import psutil

    params = sum(p.numel() for p in model.parameters())
    return params * COPY_BYTES[name] < 0.5 * psutil.virtual_memory().available


def _weights(model, name: str):
    """A copy of the bf16 `model` in the weights `name` (bf16: the model itself)."""
    if name == "bf16":
        return model
    if name == "fp32":
        return copy.deepcopy(model).float()
    return quant.quantize_model(copy.deepcopy(model), name, wide_rows=0)


def fallback(error: Exception) -> Choice:
    """What auto keeps when measuring failed: bf16, with the failure in one line."""
    line = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
    return Choice("bf16", f"bf16: could not measure the other choices ({line})", 0, {})
