"""Arguments and helpers shared by the sub-commands."""

from __future__ import annotations

import argparse
import sys

from engine.config import DEVICE_CHOICES, QUANT_CHOICES, STEP_CHOICES, ModelSpec
from engine.errors import QuickdraftError


def add_model_args(parser: argparse.ArgumentParser, start: bool = False) -> None:
    """The model flags; `start`: the model the app starts with (default: the last one used)."""
    parser.add_argument("--model", default=None if start else "default",
                        help="'default' (bundled SmolLM2-135M-Instruct), a local folder, a .gguf "
                             "file, a repo id, or REPO:FILE.gguf"
                             + (" (default: the last one used)" if start else ""))
    parser.add_argument("--gguf-file", metavar="NAME", default=None,
                        help="with a repo id as --model: the GGUF file of that repo to use")
    parser.add_argument("--quant", default="auto", choices=QUANT_CHOICES,
                        help="weights: auto picks per device (default: auto)")
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                        help="where the model runs: auto (a CUDA GPU, else Apple's GPU, else "
                             "the CPU; the line after loading says which and why)")
    parser.add_argument("--step", default="auto", choices=STEP_CHOICES,
                        help="how decode steps run: auto (the lean step, compiled, where the "
                             "model's family allows), eager (the lean step, never compiled), "
                             "transformers (the model's own forward)")
    parser.add_argument("--wide-copies", action="store_true",
                        help="int4/int8w: also keep bf16 copies of the weights for steps of "
                             "many tokens where this CPU runs them faster (more memory)")
    parser.add_argument("--requantize", action="store_true",
                        help="--quant auto on a CPU: measure which weights to use again "
                             "(answers and speed) instead of using the remembered choice")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow code shipped with the --model to run, for that model only "
                             "(off by default; the page cannot switch it on)")


def gguf_source(model: str, gguf_file: str | None) -> str:
    """`--model REPO --gguf-file NAME` -> "REPO:NAME", the form the loader takes."""
    if gguf_file is None:
        return model
    if model.count("/") != 1 or ":" in model:
        raise QuickdraftError("--gguf-file goes with a Hugging Face repo id as --model "
                              "(owner/name); for a file on disk give its path to --model")
    return f"{model}:{gguf_file}"


def model_spec(args: argparse.Namespace) -> ModelSpec | None:
    """The model the flags name; None when --model was left to its default of None."""
    if args.model is None:
        return None
    return ModelSpec(source=gguf_source(args.model, args.gguf_file), quant=args.quant,
                     device=args.device, trust_remote_code=args.trust_remote_code,
                     step=args.step, wide_copies=args.wide_copies,
                     requantize=args.requantize)


def load(args: argparse.Namespace, compiled: str = "load"):
    """Load the model the arguments name, telling the user on stderr. `compiled`: what to do
    about the compiled decode step (engine/lean/compiled.py) where none is built on this
    machine yet: "load" only uses one already built, "watch" builds it in a builder process
    while decoding eagerly, "wait" builds it first (timings then measure the compiled
    step), with a progress line."""
    from app.commands.progress_line import ProgressLine
    from engine.model.loading import load_model, start_compiling

    spec = model_spec(args)
    print(f"Loading {spec.source} ({args.quant})...", file=sys.stderr, flush=True)
    lm = load_model(spec, lambda message: print(message, file=sys.stderr, flush=True))
    bar = ProgressLine(sys.stderr) if compiled == "wait" else None
    try:
        start_compiling(lm, compiled, report=bar)
    finally:
        if bar is not None:
            bar.close()
    print(f"Loaded {lm.model_id} as {lm.quant} on {lm.device} in {lm.load_seconds:.1f} s; "
          f"decode step: {lm.target.name}", file=sys.stderr, flush=True)
    if lm.device_line:
        print(f"Device: {lm.device_line}", file=sys.stderr, flush=True)
    if lm.quant_reason and lm.device.type != "cpu":
        print(f"Weights: {lm.quant_reason}", file=sys.stderr, flush=True)
    return lm


def build_for_next_start(lm) -> None:
    """Before a one-shot command ends on the eager step: have the compiled step built for
    the next start by a builder process that outlives this one (engine/lean/builder.py),
    saying so on stderr. Nothing where it is built, building, or not wanted."""
    from engine.model.loading import start_compiling

    if lm.spec.step != "auto" or lm.target.name != "lean-eager":
        return
    start_compiling(lm, "detach")
    print("note: building the compiled decode step for this model and machine in the "
          "background (once, about a minute of every core); the next start uses it",
          file=sys.stderr, flush=True)
