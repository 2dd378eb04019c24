#!/usr/bin/env python3
"""Everything that only a GPU can show, in one command with one summary table.

    python -m scripts.gpu_check [--reduced] [--out DIR]

On a CUDA machine (under ~10 minutes): the family matrix and the reply-end tests on CUDA in
fp32 (exact) with every drafter, greedy and sampled; the lean step against transformers on
every family it covers, and its CUDA-graph step against the eager one; the
bundled model loaded in fp32, bf16, NF4 and int8 with one greedy and one sampled reply per
drafter (fp32 must match Off token for token; the other precisions report their match);
2-minute Medusa and Kangaroo training runs and replies with what they built; and
scripts.bench_gpu on a short setting. Exits non-zero when any check fails.

Without CUDA, or with --reduced, it runs the same checks on the CPU in a reduced form (the
matrix on one family, fp32 only, greedy replies, no training or bench), which is how the
test suite keeps this script working. Run it with the project's environment (.venv/bin/python).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Name three uses of a paper clip, one per line."
UNTRAINED = ("off", "lookup", "auto")
TRAINED = ("medusa", "medusa+lookup", "kangaroo", "kangaroo+lookup", "auto")


@dataclass
class Check:
    """One line of the summary."""

    name: str
    ok: bool
    seconds: float
    detail: str = ""


@dataclass
class Runner:
    """Runs commands from the repository root and keeps one Check per command."""

    env: dict[str, str]
    checks: list[Check] = field(default_factory=list)

    def command(self, name: str, argv: list[str], extra_env: dict | None = None,
                timeout: int = 600) -> subprocess.CompletedProcess | None:
        begin = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=ROOT, env={**self.env, **(extra_env or {})},
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.checks.append(Check(name, False, time.perf_counter() - begin, "timed out"))
            return None
        tail = (done.stdout + done.stderr).strip().splitlines()
        self.checks.append(Check(name, done.returncode == 0, time.perf_counter() - begin,
                                 tail[-1][:110] if tail else ""))
        return done

    def chat(self, quant: str, accel: str, temperature: float = 0.0) -> list[int] | None:
        name = f"chat {quant} {accel}" + (f" T={temperature}" if temperature else "")
        done = self.command(name, [sys.executable, "launcher.py", "chat", "--prompt", PROMPT,
                                   "--quant", quant, "--accel", accel, "--json", "--seed", "1",
                                   "--temperature", str(temperature),
                                   "--max-new-tokens", "48"])
        if done is None or done.returncode != 0:
            return None
        out = json.loads(done.stdout.strip().splitlines()[-1])
        self.checks[-1].detail = (f"{out['stats']['tokens']} tokens, "
                                  f"{out['stats']['mean_accepted']:.2f} tokens/step")
        return out["token_ids"]

    def replies(self, quant: str, methods: tuple[str, ...], sampled: bool = True) -> None:
        """A greedy reply per method compared with Off, then (`sampled`) a sampled one."""
        off = self.chat(quant, "off")
        for accel in methods:
            if accel != "off":
                ids = self.chat(quant, accel)
                if ids is not None and off is not None:
                    same = ids == off
                    check = self.checks[-1]
                    check.detail += "; same tokens as Off" if same else "; differs from Off"
                    check.ok = check.ok and (same or quant != "fp32")  # fp32 is exact
            if sampled:
                self.chat(quant, accel, temperature=0.8)


def run_checks(runner: Runner, cuda: bool, out: Path) -> None:
    py = sys.executable
    matrix = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "tests/engine/test_family_matrix.py", "tests/engine/test_reply_ends.py",
              "tests/engine/test_quant.py"]
    device_env = {"QUICKDRAFT_TEST_DEVICE": "cuda" if cuda else "cpu"}
    if not cuda:
        # one family, one drafter, one low-bit kind: the command's plumbing (the suite runs
        # the rest on the CPU anyway)
        matrix += ["-k", "greedy_to_the_end and llama-gqa-lookup] or llama-gqa-int4-2]"]
    runner.command("matrix fp32 " + ("cuda" if cuda else "cpu, one family"), matrix, device_env)
    # the lean step against transformers on every family, and graphed against eager
    lean = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_lean.py"]
    if not cuda:
        lean += ["-k", "(decodes_as_transformers or graphed) and llama"]
    runner.command("lean step fp32 " + ("cuda, graphs" if cuda else "cpu, static buffers"), lean,
                   device_env, timeout=900)
    # The CPU form skips the sampled replies: the suite samples on the CPU elsewhere, and
    # each reply here is a process that loads the model.
    runner.replies("fp32", UNTRAINED, sampled=cuda)
    if not cuda:
        return
    for quant in ("bf16", "int4", "int8w", "nf4", "int8"):  # int4/int8w: tinygemm, int8pack
        runner.replies(quant, UNTRAINED)
    for method in ("medusa", "kangaroo"):
        runner.command(f"train {method} 2 min",
                       [py, "launcher.py", "train", "--method", method, "--max-minutes", "2"],
                       timeout=240)
    for quant in ("bf16", "nf4"):
        runner.replies(quant, TRAINED)
    runner.command("bench_gpu (64 tokens)",
                   [py, "-m", "scripts.bench_gpu", "--out", str(out / "bench"),
                    "--methods", "hf,vanilla,lookup,medusa+lookup,kangaroo+lookup,auto",
                    "--max-new-tokens", "64"], timeout=300)


def summary(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  seconds  detail"]
    lines += [f"{c.name:<{width}}  {'ok' if c.ok else 'FAIL':<6}  {c.seconds:7.1f}  {c.detail}"
              for c in checks]
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks) - failed} passed, {failed} failed")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reduced", action="store_true",
                        help="the CPU form: one family, fp32, no training or bench")
    parser.add_argument("--out", default="gpu-check", help="folder for the bench report")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.reduced
    # Status lines and model loading go through the launcher with the current interpreter.
    env = {**os.environ, "QUICKDRAFT_NO_BOOTSTRAP": "1", "HF_HUB_OFFLINE": "1"}
    runner = Runner(env)
    where = "CUDA: " + torch.cuda.get_device_name(0) if cuda else "the CPU (reduced)"
    print(f"gpu_check on {where}", flush=True)
    run_checks(runner, cuda, Path(args.out).resolve())
    print(summary(runner.checks))
    return 0 if all(c.ok for c in runner.checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
