"""Self-distillation data: the loaded model answers seed prompts through its own chat
template, so drafters learn what this model really says (Medusa §2.3.2).

Seeds are the bundled assets/seed_prompts.jsonl plus an optional user file. Multi-turn seeds
are answered turn by turn (the next user turn follows the model's own answer). Answers are
sampled in batches with left padding, and every finished conversation is appended to a
JSONL file at once, so an interrupted run resumes where it stopped without duplicates.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path

from engine.paths import data_dir
from engine.progress import Eta, Progress, ProgressFn
from engine.stored_files import read_text
from trainer.answering import Run, answer_seeds
from trainer.features import conversation_tokens
from trainer.seeds import DataBudget, build_seeds

DATA_BYTES = 2**30  # the self-distilled answers file: a larger one is not read


def data_path(lm) -> Path:
    """Where the self-distilled conversations of this model live."""
    return data_dir() / "selfdistill" / lm.fingerprint / "conversations.jsonl"


def load_conversations(path: Path) -> list[list[dict]]:
    """The stored conversations: each a list of {"role", "content"} messages (the user
    turns and the model's answers), in file order. A torn last line is skipped."""
    return [rec["messages"] for rec in _records(Path(path))]


def _records(path: Path) -> list[dict]:
    """The file's records; none from a file that is absent or does not read as a stored
    file (engine/stored_files.py: a link, a FIFO, not UTF-8 text)."""
    try:
        text = read_text(path, DATA_BYTES)
    except (OSError, ValueError):
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line torn by a kill mid-write (or not the app's)
        if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            out.append(rec)
    return out


def _repair(path: Path) -> None:
    """Cut a torn last line (a kill mid-write) so appending starts on a fresh line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def generate_data(lm, out_path: Path, prompt_files: list[Path] | None, budget: DataBudget,
                  progress: ProgressFn, cancel: threading.Event | None = None) -> dict:
    """Answer seeds until the budget is spent; resumes an existing file.

    The time budget counts every run on this file (kept in a sidecar .meta.json), so a run
    killed and restarted generates only what the first one had left. Returns
    {"conversations", "tokens", "seconds", "new"}: totals for the file and the number of
    conversations this run added.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _repair(out_path)
    meta_path = out_path.with_suffix(".meta.json")
    spent = _read_meta(meta_path).get("seconds", 0.0)
    stored = _records(out_path)
    done = {rec.get("key") for rec in stored}
    tokens = sum(conversation_tokens(lm, rec["messages"]) for rec in stored)
    todo = [s for s in build_seeds(prompt_files, budget) if s.key not in done]
    target = min(budget.max_conversations, len(done) + len(todo))
    holds_out = functools.partial(held_out, fraction=budget.heldout_fraction)
    run = Run(len(done), target, spent, meta_path, tokens,
              sum(holds_out(rec.get("key", "")) for rec in stored), holds_out)
    eta = Eta(max(1, target - len(done)))
    _report(progress, run, budget, None)
    with out_path.open("a", encoding="utf-8") as fh:
        answer_seeds(lm, fh, todo, budget, run,
                     lambda: _report(progress, run, budget, eta.left(run.count - len(done))),
                     cancel)
    total_tokens = sum(int(rec.get("tokens", 0)) for rec in _records(out_path))
    return {"conversations": run.count, "tokens": total_tokens, "seconds": round(run.spent, 1),
            "new": run.count - len(done)}


def _report(progress: ProgressFn, run: Run, budget: DataBudget, left: float | None) -> None:
    """The stage ends at the conversation target or the time budget, whichever comes first:
    the bar shows the nearer of the two."""
    used = budget.used(run.spent, run.tokens)
    frac = min(1.0, max(run.count / max(1, run.target), used / max(1e-9, budget.max_seconds)))
    time_left = max(0.0, budget.max_seconds - used)
    eta = time_left if left is None else min(left, time_left)
    rate = run.per_minute()
    speed = "" if rate is None else f", {_thousands(rate)} answer tokens/min"
    progress(Progress("data", round(frac * 1000), 1000, f"{run.count} conversations{speed}",
                      eta))


def _thousands(n: float) -> str:
    """58.3k for 58,312; 950 for 950.4."""
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def split_heldout(path: Path, fraction: float) -> tuple[list[list[dict]], list[list[dict]]]:
    """(train, held-out) conversations, split by seed prompt: every sample of a seed lands on
    the same side, so held-out figures measure prompts the drafter never saw."""
    train, heldout = [], []
    for rec in _records(Path(path)):
        (heldout if held_out(rec.get("key", ""), fraction) else train).append(rec["messages"])
    return train, heldout


def held_out(key: str, fraction: float) -> bool:
    """Whether the conversation of seed `key` is held out (every pass of a seed alike)."""
    digest = str(key).split("#")[0]
    return int(hashlib.sha1(digest.encode()).hexdigest()[:8], 16) % 10000 < fraction * 10000


def _read_meta(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
