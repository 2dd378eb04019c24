"""`--quant auto` on a CPU: the smallest weights that answer as well as the reference and
are clearly faster, measured once per machine, model, torch version and thread count, and
remembered; measured in bounded time (BUDGET_S on this CPU, whatever the model's size),
saying how far it got as it goes.

The reference is bf16 for a model folder or hub model (engine/model/loading.py) and the file's own
weights, expanded, for a GGUF file whose kept format is not exactly the file's (a file kept
exactly needs no gate: its own format is the choice, engine/model/loading.py).

Quality is judged on replies, not only on a text's perplexity: each candidate answers
held-out questions with checkable answers (engine/weights/quant_answers.py: a reply stops once it is
decided, and a candidate that follows the reference's reply token for token is not asked
again) and is admitted when it answers at least as many right as the reference minus one and
its perplexity on a held-out text (assets/heldout_text.txt) is within PPL_TOLERANCE of the
reference's. The questions and the held-out text are cut to what fits in the budget: a
larger model answers fewer questions, and one too slow to answer any in the budget keeps
the reference (saying so).

Speed is judged on ratios, never on one clock reading: the admitted candidates are timed
in interleaved rounds (each round times every candidate, in a rotating order), and a
smaller candidate replaces a larger one only if its plain step is FASTER times faster in the
median round. A busy machine slows all candidates of a round alike, so the same machine
picks the same weights idle and under load; rounds go on until every comparison is clear
or the budget is spent (unclear: the larger weights stay)."""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from engine import devices
from engine.decode.timing import StepTimer
from engine.paths import ASSETS, atomic_write, cache_dir
from engine.weights import kernels, quant, quant_answers

HELDOUT = ASSETS / "heldout_text.txt"
PPL_TOLERANCE = 0.02  # an admitted choice loses at most 2% perplexity against the reference
RIGHT_SLACK = 1  # ... and answers at most one question fewer right than the reference
CANDIDATES = ("fp32", "bf16", "int8w", "int4")  # a model folder's, largest weights first
FASTER = 1.10  # a smaller choice must be this much faster than the larger one it replaces
MIN_ROUNDS, MAX_ROUNDS = 5, 15
HELDOUT_TOKENS = 512  # tokens of the held-out text scored (one forward), at most
MIN_HELDOUT = 64  # fewer fit in the budget: perplexity is left out of the verdict
# The measurement's budget on this CPU (AMD EPYC, 2 cores): answers, perplexity and timing
# together take about this long whatever the model's size (one batch of questions more at
# most); its shares below.
BUDGET_S = 60.0
ANSWER_SHARE, PERPLEXITY_SHARE = 0.6, 0.15  # timing gets the rest
MAX_BATCH = 16  # questions answered in one batch
FIRST_BATCH = 4  # ... in the first, which times the rest (one timed step misleads on a busy CPU)
TIMING_PROMPT = 32  # prompt tokens before the timed steps (a short prefill for large models)
FILE = "quant_choices.json"  # in the cache folder: {machine key: Choice}
VERSION = 3  # bumped when what a choice means changes: older records are measured again


@dataclass(frozen=True)
class Record:
    """What one candidate did."""

    right: int  # questions answered right
    same: int  # replies equal to the reference's (-1: not asked, admitted anyway)
    perplexity: float  # on the held-out text (0: not measured in the budget)
    ms: float  # median plain step over the rounds (0 when not timed)
    admitted: bool


@dataclass(frozen=True)
class Choice:
    """What auto picked and the figures it picked by."""

    quant: str  # fp32 | bf16 | int8w | int4 | own
    reason: str  # one line: why this one
    questions: int  # how many questions the replies were checked on
    records: dict  # {quant: Record as a dict}
    version: int = VERSION
    seconds: float = 0.0  # how long measuring took

    def line(self) -> str:
        """The record in one line (Models tab, chat --json)."""
        parts = []
        for name, r in self.records.items():
            gate = "" if r["admitted"] else " (not admitted)"
            speed = f", {r['ms']:.1f} ms/step" if r["ms"] else ""
            ppl = f", ppl {r['perplexity']:.2f}" if r["perplexity"] else ""
            answers = (f"{r['right']}/{self.questions} right, {r['same']} as the reference"
                       if r["same"] >= 0 else "answers not checked")
            parts.append(f"{name} {answers}{ppl}{speed}{gate}")
        return f"auto picked {self.quant}: " + "; ".join(parts)


@dataclass(frozen=True)
class Candidate:
    """Weights auto may choose."""

    name: str  # a --quant choice
    make: Callable  # the reference model -> a model in these weights (it may be the reference)
    copy_bytes: float  # bytes per parameter a copy takes beside the reference (0: none)


def ladder() -> list[Candidate]:
    """A model folder's candidates, made from its bf16 weights: fp32, bf16 (the reference),
    int8w, int4."""
    return [Candidate("fp32", lambda m: copy.deepcopy(m).float(), 4.0),
            Candidate("bf16", lambda m: m, 0.0),
            Candidate("int8w", lambda m: _quantized(m, "int8w"), 1.1),
            Candidate("int4", lambda m: _quantized(m, "int4"), 0.8)]


def _quantized(model, name: str):
    return quant.quantize_model(copy.deepcopy(model), name, wide_rows=0)


def machine_key(fingerprint: str) -> str:
    """The model, the torch build, the CPU, the thread count and the int8 kernel (its
    arithmetic differs from PyTorch's) a choice was measured on."""
    kernel = "own int8 kernel" if kernels.available() else "torch kernels"
    return f"{fingerprint}|{devices.machine().timing_key(kernel)}"


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


# --- the choice (pure) -------------------------------------------------------------------


def admitted(right: dict, ppl: dict, reference: str = "bf16",
             tolerance: float = PPL_TOLERANCE) -> list[str]:
    """The candidates (in their order) that answer as well as the reference: right answers
    at least the reference's minus RIGHT_SLACK, perplexity within `tolerance` (where it was
    measured). The reference, and fp32 beside bf16, always are."""
    def good(q: str) -> bool:
        if q == reference or (q == "fp32" and reference == "bf16"):
            return True
        close = not ppl.get(q) or ppl[q] <= ppl[reference] * (1 + tolerance)
        return right[q] >= right[reference] - RIGHT_SLACK and close
    return [q for q in right if good(q)]


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


def plan_batch(left_s: float, fixed_s: float, per_question_s: float, remaining: int) -> int:
    """Questions the next batch can answer in `left_s` seconds, a batch costing `fixed_s`
    (the reference's reply steps, shared by the batch's rows) plus `per_question_s` a
    question (prompts read, the other candidates reading the reference's replies): none
    when not even one fits."""
    if left_s <= fixed_s:
        return 0
    fit = int((left_s - fixed_s) // per_question_s) if per_question_s > 0 else MAX_BATCH
    return max(0, min(MAX_BATCH, remaining, fit))


# --- measuring ---------------------------------------------------------------------------


@dataclass
class _Run:
    """One measurement's inputs and clock."""

    tokenizer: object
    window: int  # the model's context
    eos: set  # tokens that end a reply
    report: Callable[[str], None]
    budget_s: float
    start: float

    def left(self, share: float) -> float:
        """Seconds left for work that ends at `share` of the budget."""
        return self.budget_s * share - (time.perf_counter() - self.start)

    def say(self, message: str) -> None:
        spent = time.perf_counter() - self.start
        self.report(f"{message} (choosing weights, first time only: {spent:.0f} s of at "
                    f"most ~{self.budget_s:.0f} s)")


def measure(model, tokenizer, wrap: Callable, window: int, eos: tuple[int, ...],
            report=None, candidates: list[Candidate] | None = None,
            reference: str = "bf16", default: str | None = None,
            budget_s: float = BUDGET_S) -> Choice:
    """Measure `candidates` (default: the ladder made from a bf16 `model`, left unchanged)
    against `reference` (one of them, whose model is `model`) in about `budget_s` seconds;
    `wrap(model, quant)` makes a LoadedModel to time plain steps with; `window`: the model's
    context; `eos`: the tokens that end a reply (engine.model.loading.eos_ids). With a `default`,
    nothing is timed: it is the choice where it is admitted or where no answer could be
    checked in the budget, else the reference."""
    run = _Run(tokenizer, window, set(eos), report or (lambda _m: None), budget_s,
               time.perf_counter())
    built = {}
    for c in candidates or ladder():
        if c.copy_bytes and not room_for(model, c.copy_bytes):
            run.say(f"skipping {c.name} weights: a copy would not fit in memory beside the model")
            continue
        if c.copy_bytes:
            run.say(f"making the {c.name} weights")
        built[c.name] = c.make(model)
    run.start = time.perf_counter()  # the budget is the measuring's (copies are made once)
    checked, right, same = _answers(built, reference, run)
    ppl = _perplexities(built, run)  # with the answers' unused time where none fit
    # no question answered in the budget: perplexity alone admits, where it was measured
    order = admitted(right, ppl, reference) if checked or ppl else [default or reference]
    measured = list(built)
    if default is not None:
        best = default if default in order else reference
        rounds, said = [], [f"{default} {'admitted' if default in order else 'refused'}"]
    else:
        built = {name: built[name] for name in order}  # refused copies go before timing
        rounds = _rounds(built, wrap, run) if len(order) > 1 else []
        best, _clear, said = pick(order, rounds) if rounds else (order[0], True, [])
    records = {name: asdict(Record(
        right[name], same[name], round(ppl.get(name, 0.0), 3),
        round(statistics.median(r[name] for r in rounds) * 1e3, 2) if name in built and rounds
        else 0.0, name in order)) for name in measured}
    why = "" if checked else (f"no question could be answered in {budget_s:.0f} s here, "
                              f"{'perplexity alone' if ppl else 'nothing'} measured; ")
    reason = (f"{best}: {why}the smallest weights answering as well as {reference} that are "
              f"clearly faster ({'; '.join(said) or 'nothing else admitted'}; "
              f"{len(rounds)} rounds, {checked} questions)")
    return Choice(best, reason, checked, records,
                  seconds=round(time.perf_counter() - run.start, 1))


def _answers(built: dict, reference: str, run: _Run) -> tuple[int, dict, dict]:
    """(questions checked, {name: right}, {name: replies equal to the reference's}): every
    candidate answers the same questions, batch by batch, while the budget lasts (fp32
    beside a bf16 reference is admitted anyway: it answers none)."""
    asked = quant_answers.prompts_that_fit(run.tokenizer, quant_answers.questions(), run.window)
    right, same = dict.fromkeys(built, 0), dict.fromkeys(built, 0)
    names = [reference] + [n for n in built if n != reference
                           and not (n == "fp32" and reference == "bf16")]
    done, (fixed, per_question) = 0, _probe(built[reference], asked, len(names))
    while done < len(asked):
        size = plan_batch(run.left(ANSWER_SHARE), fixed, per_question, len(asked) - done)
        size = min(size, FIRST_BATCH) if done == 0 else size
        if size == 0:
            break
        begin = time.perf_counter()
        batch = asked[done:done + size]
        prompts, answers = [p for p, _a in batch], [a for _p, a in batch]
        ref = None
        for name in names:
            run.say(f"checking {name}'s answers: questions {done + 1}-{done + size} of "
                    f"{len(asked)}")
            got, equal = quant_answers.answer(built[name], run.tokenizer, prompts, answers,
                                              run.eos, ref)
            ref = got if name == reference else ref
            right[name] += sum(quant_answers.is_right(run.tokenizer.decode(g), a)
                               for g, a in zip(got, answers, strict=True))
            same[name] += sum(equal)
        # the estimate, scaled to what this batch took
        took, guess = time.perf_counter() - begin, fixed + size * per_question
        fixed, per_question = fixed * took / guess, per_question * took / guess
        done += size
    if done and "fp32" in built and "fp32" not in names:
        right["fp32"], same["fp32"] = right[reference], -1  # not asked: -1 "as the reference"
    return done, right, same


def _probe(model, asked: list, candidates: int) -> tuple[float, float]:
    """(fixed, per question) seconds a batch of questions costs `candidates` candidates,
    from the reference's prefill of one prompt and one reply step, timed once: the
    reference's reply steps are shared by a batch's rows; every question costs its prompt
    and, for each other candidate, a read of prompt and reply (a quarter of the rows again
    where it departs from the reference's reply)."""
    if not asked:
        return 0.0, 0.0
    prompt = asked[0][0]
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        model(input_ids=ids[:, :2])  # first calls set things up: not what a batch costs
        begin = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        per_token = (time.perf_counter() - begin) / len(prompt)
        begin = time.perf_counter()
        model(input_ids=ids[:, -1:], cache=out.cache, use_cache=True)
        step = time.perf_counter() - begin
    reply = quant_answers.REPLY_TOKENS
    fixed = reply * step * (1 + 0.25 * (candidates - 1))
    per_question = per_token * (len(prompt) + (candidates - 1) * 1.25 * (len(prompt) + reply))
    return fixed, per_question


def _perplexities(built: dict, run: _Run) -> dict:
    """{name: perplexity on as much of the held-out text as the budget allows} ({} when
    fewer than MIN_HELDOUT tokens fit)."""
    ids = heldout_ids(run.tokenizer, min(HELDOUT_TOKENS, run.window))
    left = run.left(ANSWER_SHARE + PERPLEXITY_SHARE)
    first = next(iter(built.values()))
    begin = time.perf_counter()
    perplexity(first, ids[:, :MIN_HELDOUT])
    per_token = (time.perf_counter() - begin) / MIN_HELDOUT
    tokens = min(ids.shape[1], int(left / max(per_token * len(built), 1e-9)))
    if tokens < MIN_HELDOUT:
        return {}
    run.say(f"perplexity of each choice on {tokens} held-out tokens")
    return {name: perplexity(m, ids[:, :tokens]) for name, m in built.items()}


def _rounds(built: dict, wrap: Callable, run: _Run) -> list[dict]:
    """Interleaved timing rounds of the admitted candidates' plain steps, until every
    comparison is clear (after MIN_ROUNDS) or MAX_ROUNDS or the budget is spent."""
    order = list(built)
    steps = {name: StepTimer(wrap(built[name], name), prompt_len=TIMING_PROMPT)
             for name in order}
    rounds: list[dict] = []
    while len(rounds) < MAX_ROUNDS:
        run.say(f"timing {', '.join(order)} in turn (round {len(rounds) + 1})")
        names = order[len(rounds) % len(order):] + order[:len(rounds) % len(order)]
        rounds.append({name: steps[name].seconds() for name in names})
        clear = pick(order, rounds)[1]
        if (clear and len(rounds) >= MIN_ROUNDS) or run.left(1.0) <= 0:
            break
    return rounds


def heldout_ids(tokenizer, limit: int = HELDOUT_TOKENS) -> torch.Tensor:
    ids = tokenizer(HELDOUT.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
    return ids[:, :limit]


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits.float().cpu(), ids[0, 1:])
    return math.exp(nll.item())


def room_for(model, copy_bytes: float) -> bool:
    """Whether a copy of `copy_bytes` per parameter fits in half the memory available now
    (all admitted copies stay loaded while they are timed in turn)."""
    import psutil

    params = sum(p.numel() for p in model.parameters())
    return params * copy_bytes < 0.5 * psutil.virtual_memory().available


def fallback(error: Exception) -> Choice:
    """What auto keeps when measuring failed: bf16, with the failure in one line."""
    line = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
    return Choice("bf16", f"bf16: could not measure the other choices ({line})", 0, {})
