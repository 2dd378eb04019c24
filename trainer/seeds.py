"""What self-distillation answers: the seed conversations (the bundled
assets/seed_prompts.jsonl plus the user's files), in the order a time-limited run covers
every category, and the budget that says when answering stops and how answers are sampled."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from engine.paths import ASSETS
from engine.prompt_files import PromptRecord, read_prompt_file

SEED_FILE = ASSETS / "seed_prompts.jsonl"
SEED_CATEGORY = "user"  # for prompts whose file gives no category


@dataclass(frozen=True)
class DataBudget:
    """When data generation stops, and how answers are sampled."""

    max_conversations: int = 3000  # stop once the file holds this many conversations
    max_seconds: float = 600.0  # generation time for this file, summed over resumed runs,
    # plus what the stages after it will spend on the file's tokens (prep_s_per_token)
    prep_s_per_token: float = 0.0  # seconds the features stage (and Medusa's teacher) will
    # spend per stored conversation token, timed by the pipeline: more data costs them too
    # conversations answered together: rows of continuous batching (64 measured fastest
    # on the bundled model, 2 CPU cores: 32 and 128 were slower), or generate()'s batch
    batch_size: int = 64
    temperature: float = 0.7  # sampling temperature: > 0 covers what the model really says
    greedy_first_pass: bool = True  # pass 0 answers greedily: the text greedy decoding sees
    max_new_tokens: int = 256  # cap per answer
    samples_per_seed: int = 8  # passes over the seed set, each with fresh samples
    seed: int = 0  # fixes the seed order and the sampling RNG per batch
    # hidden-state layers the answering forwards record for training (trainer/recorded.py),
    # set by the pipeline from the method's trainer; () records nothing
    record_layers: tuple[int, ...] = ()
    # (train, held-out) conversations the time budget does not stop short of, split as the
    # trainer will split them (heldout_fraction): the smallest budget still trains
    least: tuple[int, int] = (0, 0)
    heldout_fraction: float = 0.06

    def used(self, seconds: float, tokens: int) -> float:
        """The budget a file with `tokens` conversation tokens made in `seconds` has used."""
        return seconds + self.prep_s_per_token * tokens


@dataclass(frozen=True)
class Seed:
    """One seed conversation to answer, in one of its sampling passes."""

    key: str  # stable id (content hash + pass): what resuming compares
    sample: int  # which pass over the seed set (0 = first)
    turns: tuple[str, ...]  # user turns, answered in order
    category: str


def _user_turns(record: PromptRecord) -> tuple[str, ...]:
    """What the model answers for a record: a "history"'s user turns come first, answered
    by the model itself (its own answers are what self-distillation learns from)."""
    earlier = tuple(t["content"] for t in record.history if t["role"] == "user")
    return earlier + record.turns


def build_seeds(prompt_files: list[Path] | None, budget: DataBudget) -> list[Seed]:
    """All (seed, pass) pairs in generation order: pass by pass, each pass shuffled, so a
    time-limited run still covers every category."""
    records = read_prompt_file(SEED_FILE, SEED_CATEGORY)
    for path in prompt_files or []:
        records += read_prompt_file(path, SEED_CATEGORY)
    turns_of = [_user_turns(r) for r in records]
    rng = random.Random(budget.seed)
    seeds: list[Seed] = []
    for sample in range(budget.samples_per_seed):
        for i in _pass_order(turns_of, budget.batch_size, rng):
            turns = turns_of[i]
            digest = hashlib.sha1(json.dumps(turns).encode()).hexdigest()[:12]
            seeds.append(Seed(f"{digest}#{sample}", sample, turns, records[i].category))
    return seeds


def _pass_order(turns_of: list[tuple[str, ...]], batch: int, rng: random.Random) -> list[int]:
    """One pass over the seeds, shuffled, in batch-sized blocks of single-turn or of
    multi-turn seeds (later turns then batch well), the multi-turn blocks spread evenly
    so that a run cut short by its time budget still has both kinds and every category."""
    single = [i for i, turns in enumerate(turns_of) if len(turns) == 1]
    multi = [i for i, turns in enumerate(turns_of) if len(turns) > 1]
    rng.shuffle(single)
    rng.shuffle(multi)
    blocks = [single[j : j + batch] for j in range(0, len(single), batch)]
    every = max(1, round(len(blocks) / max(1, -(-len(multi) // batch))))  # singles per multi
    order: list[int] = []
    for n, block in enumerate(blocks):
        order += block
        if n % every == every - 1 and multi:
            order += multi[:batch]
            multi = multi[batch:]
    return order + multi
