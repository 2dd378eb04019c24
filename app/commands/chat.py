"""`chat`: one reply in the terminal, streamed; `--json` prints text, token ids and stats."""

from __future__ import annotations

import argparse
import json
import sys

from app.commands.common import add_model_args, build_for_next_start, load
from engine.config import SamplingParams
from engine.drafters.registry import ACCEL_CHOICES

HELP = "one reply in the terminal (no --prompt: an interactive terminal chat)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", help="the message; omit for an interactive chat")
    parser.add_argument("--system", default=None, help="system prompt")
    add_model_args(parser)
    parser.add_argument("--accel", default="off", choices=ACCEL_CHOICES)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--acceptance", default="lossless", choices=("lossless", "typical"),
                        help="how drafts are verified when sampling: lossless (default) or "
                             "typical (Medusa's rule: faster, not lossless)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), seed=args.seed,
                          acceptance="auto" if args.acceptance == "lossless" else "typical")


def run(args: argparse.Namespace) -> int:
    from app.service import Service
    from app.store import Store
    from engine.decode.chat_template import conversation

    params = sampling(args)
    # an empty prompt is refused before anything loads
    prompt = conversation(args.prompt, [], args.system) if args.prompt is not None else None
    # A one-shot reply uses a compiled step already built and, where there is none, has one
    # built for the next start once it has answered; a terminal chat builds it meanwhile.
    lm = load(args, "load" if args.prompt is not None else "watch")
    # The app's own parts: its accelerators, and its datastore, which learns these replies
    service = Service(Store(), lm)
    try:
        if prompt is None:
            return _interactive(service, params, args)
        step, tokens = _reply(service, params, args, prompt, echo=not args.json)
        if args.json:
            print(json.dumps({"text": step.full_text, "token_ids": tokens,
                              "accel": step.method,  # for Auto, "auto:<arm>"
                              "stats": {**step.stats.to_json(), "quant": _quant(lm)}}),
                  flush=True)
        build_for_next_start(lm)
        return 0
    finally:
        service.accels.writer.flush()  # the datastore's last write lands before the exit


def _quant(lm) -> dict:
    """Which weights replied and, where --quant auto chose them, the record it chose by."""
    choice = lm.quant_choice
    return {"quant": lm.quant, "asked": lm.spec.quant, "reason": lm.quant_reason,
            "line": choice.line() if choice is not None and choice.records else "",
            "questions": choice.questions if choice is not None else 0,
            "records": choice.records if choice is not None else {}}


def _reply(service, params, args, prompt, echo: bool):
    """Generate one reply; when `echo`, stream it to stdout and a summary to stderr.
    (the last step, the reply's token ids)"""
    from app.reply_core import Ask

    ask = Ask(prompt, params, args.accel, strict=True, learn=True)
    tokens: list[int] = []
    for step in service.replies.complete(ask, None):
        for notice in step.notices:  # e.g. it does not pay in this dtype here: plain decoding
            print(f"note: {notice}", file=sys.stderr)
        tokens.extend(step.token_ids)
        if echo:
            print(step.text, end="", flush=True)
        if step.done:
            if step.reason:  # Auto says how it drafted
                print(f"note: {step.reason}", file=sys.stderr)
            if echo:
                stats = step.stats
                print()
                print(f"[{stats.tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
                      f"{stats.mean_accepted:.2f} tokens/step, {stats.stop_reason}]",
                      file=sys.stderr)
            return step, tokens
    raise AssertionError("the reply ended without a last step")


def _interactive(service, params, args) -> int:
    from engine.decode.chat_template import conversation
    from engine.errors import PromptError

    print("Chat with the model. Empty line or Ctrl-D to quit.", file=sys.stderr)
    history: list[dict] = []
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            return 0
        if not prompt.strip():
            return 0
        try:
            step, _tokens = _reply(service, params, args,
                                   conversation(prompt, history, args.system), echo=True)
        except PromptError as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        history += [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": step.full_text}]
