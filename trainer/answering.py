"""How the data stage answers seeds: continuous batching on the lean step's batched rows
where the lean step runs the model (trainer/sampler.py), generate() on fixed batches
otherwise. Each conversation is appended to the data file when its last turn is answered;
on the batched rows its features are recorded by the same forwards (trainer/recorded.py)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.decode.chat_template import render
from trainer import recorded
from trainer.context import answer_room, fit_prompt, padded
from trainer.features import Features, conversation_tokens
from trainer.sampler import AnswerJob, Record, SamplerConfig, answers, rows_that_fit, supports_rows
from trainer.seeds import DataBudget, Seed

# Past its time budget a streamed run lets the answers under way end for at most this
# share of the budget (and at most GRACE_MAX_S): the stage ends within its budget + 3%.
GRACE_SHARE = 0.03
GRACE_MAX_S = 30.0
# Prompt tokens a row is sized for when memory limits the rows (seed prompts and later turns
# of the bundled seeds stay well under it).
TYPICAL_PROMPT = 512


def answer_seeds(lm, fh, todo: list[Seed], budget: DataBudget, run: Run, report,
                 cancel: threading.Event | None) -> None:
    """Answer `todo` in order until the run's target or time budget, appending to `fh`."""
    answer = _answer_streamed if supports_rows(lm) else _answer_in_batches
    answer(lm, fh, todo, budget, run, report, cancel)


@dataclass
class Run:
    """Where a data run stands: conversations in the file, the target, seconds spent, the
    file's conversation tokens (what the features stage will read), and how many of its
    conversations the trainer will hold out."""

    count: int
    target: int
    spent: float
    meta_path: Path
    tokens: int = 0
    heldout: int = 0
    holds_out: Callable[[str], bool] = lambda key: False  # the trainer's split, by seed key
    answered: int = 0  # answer tokens this run wrote (its rate is what the progress shows)
    answering_s: float = 0.0  # seconds this run has answered for

    def wrote(self, n: int, seconds: float, tokens: int, keys: tuple[str, ...] = (),
              answered: int = 0) -> None:
        self.count += n
        self.spent += seconds
        self.tokens += tokens
        self.answered += answered
        self.answering_s += seconds
        self.heldout += sum(self.holds_out(k) for k in keys)
        self.meta_path.write_text(json.dumps({"seconds": round(self.spent, 2)}))

    def per_minute(self) -> float | None:
        """Answer tokens a minute this run has written, once it has written some."""
        return self.answered * 60 / self.answering_s if self.answered else None

    def enough(self, least: tuple[int, int]) -> bool:
        """Whether the file holds the (train, held-out) conversations the time budget must
        not stop short of."""
        return self.count - self.heldout >= least[0] and self.heldout >= least[1]


def _answer_in_batches(lm, fh, todo: list[Seed], budget: DataBudget, run: Run,
                       report, cancel: threading.Event | None) -> None:
    """generate() on fixed batches: for models whose cache rows cannot be swapped."""
    def budget_left() -> bool:
        return (budget.used(run.spent, run.tokens) < budget.max_seconds
                or not run.enough(budget.least))

    while todo and run.count < run.target and budget_left():
        if cancel is not None and cancel.is_set():
            break
        size = min(budget.batch_size, run.target - run.count)
        size = sum(1 for s in todo[:size] if s.sample == todo[0].sample)  # one pass per batch
        batch, todo = todo[:size], todo[size:]
        seconds, tokens, answered = _write_batch(lm, fh, batch, budget)
        run.wrote(len(batch), seconds, tokens, tuple(s.key for s in batch), answered)
        report()


def _answer_streamed(lm, fh, todo: list[Seed], budget: DataBudget, run: Run,
                     report, cancel: threading.Event | None) -> None:
    """Continuous batching (trainer/sampler.py): each conversation's next turn joins the
    batch as soon as its last answer ends; a conversation is written when it is whole, with
    its features where the budget asks for them (its last turn's prompt holds the earlier
    turns, so that turn's forwards cover every position)."""
    answer_tokens = answer_room(lm, budget.max_new_tokens)
    seeds, queue, open_convs, closing = iter(todo), deque(), 0, False
    grace = min(GRACE_SHARE * budget.max_seconds, GRACE_MAX_S)
    clock = time.perf_counter()

    def job(conv: _SeedInProgress) -> AnswerJob:
        prompt = fit_prompt(lm, conv.ask_next(lm.tokenizer), answer_tokens)
        greedy = budget.temperature <= 0 or (budget.greedy_first_pass and conv.seed.sample == 0)
        return AnswerJob(prompt, greedy, answer_tokens, conv)

    def admit() -> None:
        nonlocal open_convs
        while (len(queue) < config.batch_size and run.count + open_convs < run.target
               and not closing):
            seed = next(seeds, None)
            if seed is None:
                return
            open_convs += 1
            queue.append(job(_SeedInProgress(seed)))

    def keep_going() -> bool:
        # At the budget no new turn starts, and the answers under way get a short grace to
        # end (dropping them would waste up to a batch of half-written answers); a file
        # short of the least data to train on goes on answering until it holds it.
        nonlocal closing
        used = budget.used(run.spent + time.perf_counter() - clock, run.tokens)
        short = not run.enough(budget.least)
        if used >= budget.max_seconds and not short:
            closing = True
            queue.clear()
        cancelled = cancel is not None and cancel.is_set()
        return not cancelled and (short or used < budget.max_seconds + grace)

    rows = rows_that_fit(lm, budget.batch_size, min(lm.context_len, TYPICAL_PROMPT + answer_tokens))
    config = SamplerConfig(rows, budget.temperature)
    generator = torch.Generator(device=lm.device).manual_seed(budget.seed * 7919 + run.count)
    record = Record(budget.record_layers) if budget.record_layers else None
    writer = recorded.Writer(recorded.folder(lm))
    admit()
    for done, answer in answers(lm, queue, config, generator, keep_going, record):
        conv = done.tag
        conv.answered(lm.tokenizer, answer.ids)
        if conv.turns_left():
            queue.appendleft(job(conv))
            continue
        if answer.features is not None:
            writer.add(recorded.digest(conv.messages), _recorded(lm, conv, done, answer))
        _write(fh, conv)
        open_convs -= 1
        now = time.perf_counter()
        run.wrote(1, now - clock, conversation_tokens(lm, conv.messages), (conv.seed.key,),
                  conv.tokens)
        clock = now
        report()
        admit()
    writer.flush()
    run.wrote(0, time.perf_counter() - clock, 0)  # the unfinished answers' time counts too


def _recorded(lm, conv: _SeedInProgress, job: AnswerJob, answer) -> Features:
    """The conversation's recorded features: its last turn's prompt and answer."""
    f = answer.features
    mask = recorded.answer_mask(lm, conv.messages, len(job.prompt), len(f.ids))
    return Features(torch.tensor(f.ids), torch.tensor(mask), torch.tensor([0, len(f.ids)]),
                    f.states, f.top_ids, f.top_logits)


@dataclass
class _SeedInProgress:
    """A seed being answered turn by turn (by either way of answering)."""

    seed: Seed
    messages: list[dict] = field(default_factory=list)
    tokens: int = 0

    def ask_next(self, tokenizer) -> list[int]:
        """Add the seed's next user turn; the conversation so far as the model's prompt."""
        self.messages.append({"role": "user", "content": self.seed.turns[len(self.messages) // 2]})
        return render(tokenizer, self.messages, generation_prompt=True)

    def answered(self, tokenizer, answer: list[int]) -> None:
        """Add the model's answer (token ids, EOS cut) to the last user turn."""
        text = tokenizer.decode(answer, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        self.tokens += len(answer)

    def turns_left(self) -> bool:
        return len(self.messages) // 2 < len(self.seed.turns)


def _write(fh, conv: _SeedInProgress) -> None:
    rec = {"key": conv.seed.key, "category": conv.seed.category, "tokens": conv.tokens,
           "messages": conv.messages}
    fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    fh.flush()


def _write_batch(lm, fh, batch: list[Seed], budget: DataBudget) -> tuple[float, int, int]:
    """Answer every seed of the batch turn by turn, each turn in one batched pass, and append
    its conversations; returns the seconds it took, the conversations' tokens and their
    answer tokens."""
    start = time.perf_counter()
    digest = hashlib.sha1(f"{budget.seed}/{batch[0].key}".encode()).hexdigest()
    torch.manual_seed(int(digest[:8], 16))  # the same batch samples the same answers
    convs = [_SeedInProgress(seed) for seed in batch]
    while active := [conv for conv in convs if conv.turns_left()]:
        prompts = [conv.ask_next(lm.tokenizer) for conv in active]
        for conv, answer in zip(active, _sample(lm, prompts, batch, budget), strict=True):
            conv.answered(lm.tokenizer, answer)
    for conv in convs:
        _write(fh, conv)
    tokens = sum(conversation_tokens(lm, conv.messages) for conv in convs)
    return time.perf_counter() - start, tokens, sum(conv.tokens for conv in convs)


def _sample(lm, prompts: list[list[int]], batch: list[Seed], budget: DataBudget) -> list[list[int]]:
    """Batched sampling with left padding: one answer (token ids, EOS cut) per prompt.
    Prompt + answer fit the model's context (later turns of long conversations lose their
    oldest tokens)."""
    answer_tokens = answer_room(lm, budget.max_new_tokens)
    prompts = [fit_prompt(lm, p, answer_tokens) for p in prompts]
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else lm.eos_ids[0]
    ids, mask = padded(prompts, pad, left=True)
    greedy = budget.temperature <= 0 or (budget.greedy_first_pass and batch[0].sample == 0)
    sampling = ({"do_sample": False} if greedy else
                {"do_sample": True, "temperature": budget.temperature, "top_p": 1.0, "top_k": 0})
    with torch.inference_mode():
        out = lm.model.generate(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device),
                                **sampling, max_new_tokens=answer_tokens, pad_token_id=pad,
                                eos_token_id=list(lm.eos_ids))
    answers = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in lm.eos_ids), len(row))
        answers.append(row[:cut])
    return answers
