#!/usr/bin/env python3
"""Everything that only a GPU can show, in one command and one table.

    python -m scripts.gpu_check [--reduced] [--out DIR] [--big FOLDER]

On a CUDA machine (under 8 minutes), one row each:
- the launcher's NVIDIA detection and the lock it installs, torch's build, and the device,
  dtype and kernels Quickdraft picks there, with why;
- the bundled model and a 1B-class model loaded in bf16, fp16, int4 and nf4: the memory the
  weights take against engine/weights/memory_fit's estimate, the peak while loading, what each
  choice became on this card (int4 is NF4 before compute capability 8.0), one reply;
- greedy exactness on CUDA in fp32: the family matrix and the lean step against
  transformers, its CUDA-graph step against the eager one (tests that ran on the CPU in CI);
- the sampling acceptance rules on the device: the distributions they emit, one read of the
  device per step, the draws on a CUDA generator;
- `bench` on the bundled model with CUDA graphs on and off: every drafter's tokens/s and
  tokens per step against Off and against generate(), and whether its greedy replies equal
  generate()'s, a difference passing only where it is a near-tie of the dtype's rounding
  (engine/decode/neartie.py: cuBLAS and attention round differently for steps of different sizes);
- a 20-second Medusa training run.
The 1B-class model is Llama-3.2-1B's shapes with random weights (written once into DIR; no
download) unless --big names a real model folder. Exits non-zero when any row fails.

Without CUDA, or with --reduced, the same rows run in a reduced form on the CPU (fp32 and
bf16 loads, a 2-layer stand-in for the 1B model, one family, a one-prompt bench, no
training): how the test suite keeps this script working. Run it with the project's
environment (.venv/bin/python).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Name three uses of a paper clip, one per line."
TOLERANCE = 0.15  # measured weights within this fraction of the estimate
# Llama-3.2-1B's shapes with the bundled tokenizer's vocabulary (1.07 B parameters)
ONE_B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
             tie_word_embeddings=True, rope_theta=500000.0)
STAND_IN = dict(ONE_B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)


@dataclass
class Check:
    """One row of the table."""

    name: str
    ok: bool
    seconds: float | None
    detail: str = ""


@dataclass
class Runner:
    """Runs checks from the repository root and keeps their rows."""

    env: dict[str, str]
    checks: list[Check] = field(default_factory=list)

    def command(self, name: str, argv: list[str], timeout: int = 300,
                extra_env: dict | None = None) -> subprocess.CompletedProcess | None:
        begin = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=ROOT, env={**self.env, **(extra_env or {})},
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.checks.append(Check(name, False, time.perf_counter() - begin, "timed out"))
            return None
        tail = (done.stdout + done.stderr).strip().splitlines()
        self.checks.append(Check(name, done.returncode == 0, time.perf_counter() - begin,
                                 tail[-1][:120] if tail else ""))
        return done

    def timed(self, name: str, fn, *args) -> None:
        """A row from fn(*args) -> (ok, detail); an exception fails the row with its line."""
        begin = time.perf_counter()
        try:
            ok, detail = fn(*args)
        except Exception as exc:  # noqa: BLE001 - a row reports any failure in one line
            ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:110]}"
        self.checks.append(Check(name, ok, time.perf_counter() - begin, detail))


def device_row(cuda: bool) -> tuple[bool, str]:
    """The launcher's detection and lock, torch's build, the device picked and why."""
    import torch

    import launcher
    from engine import devices

    gpu = launcher.nvidia_gpu()
    lock, why = launcher.choose_lock(gpu=gpu)
    device = devices.pick_device("auto")
    line = devices.device_line("auto", device)
    detail = (f"{why} -> {lock.name}; torch {torch.__version__} "
              f"(CUDA {torch.version.cuda or 'none'}); {line}")
    # on a GPU machine the launcher must have found it and torch must see it
    return (not cuda or (bool(gpu) and device.type == "cuda")), detail


def model_folder(out: Path, shapes: dict, name: str) -> Path:
    """A Llama of `shapes` with random weights, bf16 safetensors and the bundled tokenizer,
    written once into `out`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.model.loading import bundled_folder

    folder = out / name
    if (folder / "model.safetensors").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(bundled_folder())
    config = LlamaConfig(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         **shapes)
    torch.manual_seed(0)
    where = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(where):  # random init of a billion weights is quick on a GPU
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_row(source: str, folder: Path, quant: str, device: str) -> tuple[bool, str]:
    """Load `source` as `quant` on `device`: its weights' bytes against the estimate, the
    peak while loading, what the choice became, and one short reply."""
    import torch

    from app.catalog import measured_size
    from engine.config import ModelSpec, SamplingParams
    from engine.decode.chat_template import conversation, encode
    from engine.decode.generate import run
    from engine.model.loading import load_model
    from engine.weights import memory_fit

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    lm = load_model(ModelSpec(source=source, quant=quant, device=device, step="eager"))
    try:
        weights = measured_size(lm.model)[1]
        estimate = memory_fit.weights_bytes(memory_fit.read_checkpoint(folder), lm.quant)
        detail = (f"{lm.quant} on {lm.device.type}: weights {weights / 2**30:.2f} GB, "
                  f"estimate {estimate / 2**30:.2f} GB")
        if cuda:
            detail += (f", +{(torch.cuda.memory_allocated() - before) / 2**30:.2f} GB on the "
                       f"card, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GB")
        ids = encode(lm.tokenizer, conversation(PROMPT))  # through the chat template
        _text, reply, _stats = run(lm, ids, SamplingParams(max_new_tokens=16))
        detail += f"; {len(reply)} tokens" + (f" ({lm.quant_reason[:60]})" if lm.quant_reason
                                               else "")
        close = abs(weights - estimate) <= TOLERANCE * estimate
        return close and len(reply) > 0 and lm.device.type == device, detail
    finally:
        del lm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def bench_rows(runner: Runner, label: str, argv: list[str], out: Path) -> None:
    """`bench` into `out`, then one row per method: tokens/s, tokens per step, against Off
    (vanilla) and generate() (hf), and greedy exactness under the near-tie rule."""
    done = runner.command(f"bench {label}", [*argv, "--out", str(out)], timeout=420)
    if done is None or done.returncode != 0:
        return
    methods = json.loads((out / "report.json").read_text())["methods"]
    off = methods.get("vanilla", {}).get("tokens_per_s") or 0.0
    for name, f in methods.items():
        flips = f.get("mismatches", [])
        wrong = [m for m in flips if not m["near_tie"]]
        exact = (f"{len(flips)} near-tie(s)" if flips and not wrong else
                 f"{len(wrong)} MISMATCH(es) beyond rounding" if wrong else "same tokens")
        vs_off = f"{f['tokens_per_s'] / off:.2f}x Off, " if off else ""
        steps = f["mean_accepted"]
        runner.checks.append(Check(
            f"  {label}: {name}", not wrong, None,
            f"{f['tokens_per_s']:.1f} tok/s, {vs_off}{f['speedup_vs_hf']:.2f}x generate(), "
            f"{steps if steps is not None else 'n/a'} tokens/step; {exact}"))


def run_checks(runner: Runner, cuda: bool, out: Path, big: Path | None) -> None:
    from engine.model.loading import bundled_folder

    py = sys.executable
    runner.timed("device and install", device_row, cuda)
    one_b = big or model_folder(out, ONE_B if cuda else STAND_IN,
                                "llama-1b-random" if cuda else "llama-stand-in")
    quants = ("bf16", "fp16", "int4", "nf4") if cuda else ("fp32", "bf16")
    for name, source, folder in (("bundled", "default", bundled_folder()),
                                 ("1B" if cuda else "1B stand-in", str(one_b), one_b)):
        for quant in quants:
            runner.timed(f"load {name} {quant}", load_row, source, folder, quant,
                         "cuda" if cuda else "cpu")
    # in file order, pytest-randomly off: the tiny models' weights and prompts are seeded,
    # and a row checks the code, not one random order's draw
    tests = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    device_env = {"QUICKDRAFT_TEST_DEVICE": "cuda" if cuda else "cpu"}
    matrix = [*tests, "tests/engine/test_family_matrix.py", "-k",
              "greedy_to_the_end" + ("" if cuda else " and llama-gqa-lookup]")]
    runner.command("fp32 exact: family matrix " + ("cuda" if cuda else "cpu, one family"),
                   matrix, 300, device_env)
    lean = [*tests, "tests/engine/lean/test_lean.py", "-k",
            "(decodes_as_transformers or graphed)" + ("" if cuda else " and llama")]
    runner.command("fp32 exact: lean step, graphed vs eager " + ("cuda" if cuda else "cpu"),
                   lean, 300, device_env)
    sampled = [*tests, "tests/engine/decode/test_verify.py",
               "tests/engine/decode/test_reply_ends.py::test_acceptance_rules_run_with_a_cuda_generator"]
    runner.command("sampled acceptance on the device " + ("cuda" if cuda else "cpu"),
                   sampled, 120, device_env)
    # on a GPU the card's half precision (fp16 before compute capability 8.0)
    bench = [py, "launcher.py", "bench", "--limit", "7" if cuda else "1",
             "--max-new-tokens", "64" if cuda else "16", "--quant", "auto" if cuda else "fp32"]
    if not cuda:
        bench += ["--methods", "hf,vanilla,lookup", "--device", "cpu"]
    bench_rows(runner, "graphs on" if cuda else "eager (cpu)", bench, out / "bench-graphs")
    if not cuda:
        return
    bench_rows(runner, "graphs off", [*bench, "--step", "eager"], out / "bench-eager")
    runner.command("train medusa 20 s", [py, "launcher.py", "train", "--method", "medusa",
                                         "--max-minutes", "0.34", "--no-chats"], 180,
                   {"QUICKDRAFT_DATA_DIR": str(out / "data")})


def summary(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  seconds  detail"]
    lines += [f"{c.name:<{width}}  {'ok' if c.ok else 'FAIL':<6}  "
              f"{'' if c.seconds is None else f'{c.seconds:.1f}':>7}  {c.detail}"
              for c in checks]
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks) - failed} passed, {failed} failed")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reduced", action="store_true",
                        help="the CPU form: fp32 and bf16, one family, a one-prompt bench")
    parser.add_argument("--out", default="gpu-check",
                        help="folder for the 1B-class model and the bench reports")
    parser.add_argument("--big", default=None, metavar="FOLDER",
                        help="a real 1B-class model folder instead of random weights")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.reduced
    # Status lines and model loading go through the launcher with the current interpreter.
    env = {**os.environ, "QUICKDRAFT_NO_BOOTSTRAP": "1", "HF_HUB_OFFLINE": "1"}
    runner = Runner(env)
    where = "CUDA: " + torch.cuda.get_device_name(0) if cuda else "the CPU (reduced)"
    print(f"gpu_check on {where}", flush=True)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_checks(runner, cuda, out, Path(args.big).resolve() if args.big else None)
    print(summary(runner.checks))
    return 0 if all(c.ok for c in runner.checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
