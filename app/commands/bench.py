"""`bench`: the speed report. Hugging Face generate() and its speculative peers against the
engine's plain loop and trained accelerators, interleaved prompt by prompt."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from app.commands.common import add_model_args, load
from app.commands.progress_line import ProgressLine
from bench.methods import METHOD_CHOICES
from engine.config import ModelSpec, SamplingParams
from engine.errors import QuickdraftError

HELP = "speed report: tokens/s, speedup over generate(), acceptance, memory, greedy match"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--prompts", default=None,
                        help="JSONL ({\"prompt\", optional \"category\", \"history\"}) or one "
                             "prompt per line (default: the bundled set, 7 categories x 12)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated, from {', '.join(METHOD_CHOICES)} (default: hf, "
                             "hf-lookup, vanilla and every trained accelerator; hf always runs)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--assistant", default=None,
                        help="a smaller model with the same tokenizer, for hf-assisted")
    parser.add_argument("--out", default=None,
                        help="folder for report.json, report.md and the PNG plots")
    parser.add_argument("--limit", type=int, default=None,
                        help="use N prompts, taken evenly across categories")
    parser.add_argument("--llama-bench", metavar="PATH", default=None,
                        help="llama.cpp's llama-bench program, run on the same GGUF file in the "
                             "same run (default: the one on PATH, if any)")
    parser.add_argument("--llama-bench-file", metavar="GGUF", default=None,
                        help="the GGUF file llama-bench runs (default: the one the model was "
                             "loaded from), e.g. a Q8_0 file to compare bf16 or int8w with")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the prompts N times, each pass with freshly built methods; "
                             "a prompt's speed is the median over the passes (default 1)")


def command_line(args: argparse.Namespace, prog: str = "python launcher.py bench") -> str:
    """The run's settings as a command that repeats it (defaults spelled out)."""
    parts = [*shlex.split(prog), "--model", args.model, "--quant", args.quant,
             "--max-new-tokens", str(args.max_new_tokens),
             "--temperature", str(args.temperature), "--seed", str(args.seed)]
    for flag, value in (("--device", None if args.device == "auto" else args.device),
                        ("--prompts", args.prompts), ("--methods", args.methods),
                        ("--assistant", args.assistant), ("--limit", args.limit),
                        ("--passes", args.passes if args.passes != 1 else None),
                        ("--llama-bench", args.llama_bench),
                        ("--llama-bench-file", args.llama_bench_file), ("--out", args.out)):
        if value is not None:
            parts += [flag, str(value)]
    if args.trust_remote_code:
        parts.append("--trust-remote-code")
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    return execute(args, command_line(args))


def execute(args: argparse.Namespace, command: str) -> int:
    """Check the arguments, load, run, print the table and write the outputs."""
    from bench.bench_run import bench_report
    from bench.methods import build_methods, method_names
    from bench.prompts import DEFAULT_PROMPTS, load_prompts, round_robin
    from bench.report import notes, overall_table, write_report

    # Everything that can be wrong with the arguments fails before the model loads.
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            seed=args.seed)
    names = method_names(args.methods, args.assistant is not None)
    if args.passes < 1:
        raise QuickdraftError("--passes must be at least 1")
    prompt_file = Path(args.prompts) if args.prompts else DEFAULT_PROMPTS
    prompts = round_robin(load_prompts(prompt_file), args.limit)
    lm = load(args, "wait")  # every method is timed on the step the app would run
    assistant = _load_assistant(args) if "hf-assisted" in names else None
    methods, skipped = build_methods(lm, names, params, assistant)
    for name, why in skipped.items():
        print(f"{name}: {why}", file=sys.stderr)
    context = {"command": command, "model": args.model, "prompt_file": str(prompt_file),
               "assistant": assistant.model_id if assistant else None}
    peer = _peer(args, lm)
    bar = ProgressLine()
    try:
        report = bench_report(lm, prompts, methods, skipped, params, context, bar, args.passes,
                              lambda: build_methods(lm, names, params, assistant)[0], peer)
    finally:
        bar.close()
    print("\n".join([*overall_table(report), "", *notes(report)]))
    if args.out:
        written = write_report(report, Path(args.out))
        print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def _peer(args: argparse.Namespace, lm):
    """llama-bench on the model's GGUF file (or the one named), or None (said on stderr)."""
    import torch

    from bench.llamabench import LlamaBench, find
    from bench.llamacpp import gguf_file

    exe = find(args.llama_bench)
    if exe is None:
        return None
    path = Path(args.llama_bench_file).expanduser() if args.llama_bench_file else gguf_file(lm)
    if path is None or not path.is_file():
        print(f"llama-bench: no GGUF file to run ({lm.model_id} was not loaded from one; "
              "name one with --llama-bench-file)", file=sys.stderr)
        return None
    return LlamaBench(exe, path, torch.get_num_threads())


def _load_assistant(args: argparse.Namespace):
    from engine.model.loading import load_model

    print(f"Loading assistant {args.assistant}...", file=sys.stderr, flush=True)
    return load_model(ModelSpec(source=args.assistant, quant=args.quant, device=args.device,
                                trust_remote_code=args.trust_remote_code))
