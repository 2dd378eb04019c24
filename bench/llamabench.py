"""The llama.cpp peer as most local users run it: its own C++ benchmark program,
`llama-bench`, on the same GGUF file, with the same threads, in the same run.

The bench asks it for a reply (a prompt of the prompts' mean length, then the longest reply
the bench allows: its "pg" test), for generation alone at that depth ("tg"), and for the
cost of a step of n tokens at that depth (what drafting on top of llama.cpp would pay per
step). From the first two come its time to read a prompt and to write a token, which price
the bench's own work: every prompt's length and its reply's tokens (`same_work`), so
llama.cpp's tokens/s counts what the methods' do (replies that end early weigh their
prompt more). It is run before and after the bench's own methods; the report keeps both.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.errors import QuickdraftError

STEP_SIZES = (1, 2, 4, 8, 16)  # tokens per step whose cost is asked for
TIMEOUT_S = 900  # one llama-bench call (a large file at depth takes minutes)


@dataclass(frozen=True)
class LlamaBench:
    """What to run and on what."""

    exe: Path  # the llama-bench program
    gguf: Path  # the GGUF file the model was loaded from (or one the user names)
    threads: int  # the same thread count the bench's methods use


def find(given: str | None) -> Path | None:
    """The llama-bench program: the one given (QuickdraftError when it is not there), else
    the one on PATH, else None."""
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise QuickdraftError(f"--llama-bench: {path} is not a file")
        return path
    found = shutil.which("llama-bench")
    return Path(found) if found else None


def measure(peer: LlamaBench, depth: int, tokens: int, repeats: int = 3) -> dict:
    """llama-bench's figures for replies of `tokens` tokens to prompts of `depth` tokens:
    tokens/s over the whole reply (prompt processing included), over generation alone at
    that depth, and ms of a step of n tokens there for n in STEP_SIZES."""
    rows = _run(peer, ["-p", ",".join(map(str, STEP_SIZES)), "-n", str(tokens),
                       "-d", str(depth), "-r", str(repeats)])
    rows += _run(peer, ["-p", "0", "-n", "0", "-pg", f"{depth},{tokens}", "-r", str(repeats)])
    generation = _row(rows, 0, tokens)
    reply = _row(rows, depth, tokens)
    # pg's tokens/s counts the prompt's tokens too; a reply's counts only the new ones
    reply_s = (depth + tokens) / float(reply["avg_ts"])
    steps = {int(r["n_prompt"]): 1e3 * int(r["n_prompt"]) / float(r["avg_ts"])
             for r in rows if r.get("n_gen") == 0 and r.get("n_prompt") in STEP_SIZES}
    token_s = 1.0 / float(generation["avg_ts"])
    return {"tokens_per_s": tokens / reply_s,
            "prompt_s": max(0.0, reply_s - tokens * token_s),  # reading `depth` tokens
            "decode_tokens_per_s": float(generation["avg_ts"]),
            "ms_per_token": 1e3 / float(generation["avg_ts"]),
            "step_ms": {n: round(ms, 3) for n, ms in sorted(steps.items())},
            "depth": depth, "tokens": tokens}


def same_work(run: dict, work: list[tuple[int, int]]) -> float:
    """llama.cpp's tokens/s for `work`, (prompt tokens, new tokens) per reply: each prompt
    read at the measured rate (scaled by its length) and each token written at the measured
    generation speed, new tokens over the whole time as the bench counts them."""
    per_prompt_token = run["prompt_s"] / run["depth"]
    seconds = sum(p * per_prompt_token + t / run["decode_tokens_per_s"] for p, t in work)
    return sum(t for _p, t in work) / seconds if seconds > 0 else 0.0


def _row(rows: list[dict], prompt: int, gen: int) -> dict:
    row = next((r for r in rows if r.get("n_prompt") == prompt and r.get("n_gen") == gen), None)
    if row is None:
        raise QuickdraftError(f"llama-bench printed no figure for {prompt} + {gen} tokens")
    return row


def _run(peer: LlamaBench, extra: list[str]) -> list[dict]:
    argv = [str(peer.exe), "-m", str(peer.gguf), "-t", str(peer.threads), "-o", "json", *extra]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise QuickdraftError(f"llama-bench did not run: {exc}") from exc
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise QuickdraftError(f"llama-bench failed (exit {done.returncode}): {last}")
    try:
        return json.loads(done.stdout)
    except ValueError as exc:
        raise QuickdraftError(f"llama-bench printed no JSON ({exc})") from exc


def note(bench: dict, baseline: str) -> str:
    """The report's line on the peer (`bench`: the report's pooled llama-bench figures)."""
    runs = ", ".join(f"{r.get('same_work_tokens_per_s', r['tokens_per_s']):.1f}"
                     for r in bench["runs"])
    steps = bench["runs"][-1]["step_ms"]
    costs = ", ".join(f"{n}: {ms / steps[1]:.2f}" for n, ms in steps.items()
                      if 1 in steps and n > 1)
    decode = bench["runs"][-1]["decode_tokens_per_s"]
    own = bench.get("reply_tokens_per_s", bench["tokens_per_s"])
    return (f"- llama-bench ({bench['exe']}, {bench['threads']} threads, "
            f"{Path(bench['gguf']).name}): {bench['tokens_per_s']:.1f} tok/s for the same "
            f"work as {baseline} (each prompt read and each reply's tokens written at "
            f"llama-bench's measured speeds; runs before and after the methods: {runs}; "
            f"every method's `vs llama-bench` prices its own replies the same way); its own "
            f"reply of {bench['tokens']} tokens to a prompt of {bench['depth']}: {own:.1f} "
            f"tok/s, prompt included; generation alone there {decode:.1f} tok/s; its n-token "
            f"step in plain steps: {costs}.")


def described(peer: LlamaBench) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(peer).items()}
