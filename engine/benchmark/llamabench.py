"""The llama.cpp peer as most local users run it: its own C++ benchmark program,
`llama-bench`, on the same GGUF file, with the same threads, in the same run.

It reports generation speed (tokens/s) over `n` tokens after `depth` tokens of context, so
the bench asks it for its replies' length at the prompts' mean length, and for the cost of a
step of n tokens at that depth (what drafting on top of llama.cpp would pay per step). It is
run before and after the bench's own methods; the report keeps both runs.
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
    """llama-bench's figures at `depth` tokens of context: tokens/s generating `tokens`
    tokens ("tg"), and ms of a step of n tokens for n in STEP_SIZES ("pp n")."""
    rows = _run(peer, ["-p", ",".join(map(str, STEP_SIZES)), "-n", str(tokens),
                       "-d", str(depth), "-r", str(repeats)])
    generation = next((r for r in rows if r.get("n_gen") == tokens), None)
    if generation is None:
        raise QuickdraftError("llama-bench printed no generation figure")
    steps = {int(r["n_prompt"]): 1e3 * int(r["n_prompt"]) / float(r["avg_ts"])
             for r in rows if r.get("n_gen") == 0 and r.get("n_prompt") in STEP_SIZES}
    return {"tokens_per_s": float(generation["avg_ts"]),
            "stdev_tokens_per_s": float(generation.get("stddev_ts", 0.0)),
            "ms_per_token": 1e3 / float(generation["avg_ts"]),
            "step_ms": {n: round(ms, 3) for n, ms in sorted(steps.items())},
            "depth": depth, "tokens": tokens}


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


def described(peer: LlamaBench) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(peer).items()}
