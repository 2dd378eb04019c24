"""Command-line entry: `python launcher.py [chat|train|bench|serve] ...` (no args: the app)."""

from __future__ import annotations

import argparse
import logging
import sys

from app.commands import bench, chat, serve, train, ui
from engine.errors import QuickdraftError

COMMANDS = {"chat": chat, "train": train, "bench": bench, "serve": serve, "ui": ui}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python launcher.py",
        description="Quickdraft: chat with a local LLM, accelerated by self-speculative drafting.",
    )
    sub = parser.add_subparsers(dest="command")
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str]) -> int:
    """Run one sub-command; user errors print one line, never a traceback."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    parser = build_parser()
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["ui", *argv]  # the bare command and its flags start the app
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except QuickdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
