"""Arguments and helpers shared by the sub-commands."""

from __future__ import annotations

import argparse
import sys

from engine.config import QUANT_CHOICES, ModelSpec


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (bundled SmolLM2-135M-Instruct), a local folder, or a repo id")
    parser.add_argument("--quant", default="auto", choices=QUANT_CHOICES,
                        help="weights: auto picks per device (default: auto)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow code shipped with a hub model to run (off by default)")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(source=args.model, quant=args.quant, device=args.device,
                     trust_remote_code=args.trust_remote_code)


def load(args: argparse.Namespace):
    """Load the model the arguments name, telling the user on stderr."""
    from engine.loading import load_model

    print(f"Loading {args.model} ({args.quant})...", file=sys.stderr, flush=True)
    lm = load_model(model_spec(args))
    print(f"Loaded {lm.model_id} as {lm.quant} on {lm.device} in {lm.load_seconds:.1f} s",
          file=sys.stderr, flush=True)
    return lm
