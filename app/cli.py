"""Command-line entry: `python launcher.py [chat|train|bench|serve] ...` (no args: the app)."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from app.commands import bench, chat, serve, train, ui
from engine.errors import QuickdraftError

COMMANDS = {"chat": chat, "train": train, "bench": bench, "serve": serve, "ui": ui}
# Warnings libraries raise about their own code, which nobody running Quickdraft can act on:
# torch's pytree trips its own deprecation of LeafSpec while steps compile, and printed it
# again after every change to the warning filters (five times in a first start).
LIBRARY_WARNINGS = [(FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python launcher.py",
        description="Quickdraft: chat with a local LLM, accelerated by self-speculative drafting.",
    )
    sub = parser.add_subparsers(dest="command")
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def quiet_library_warnings() -> None:
    """Leave out the console warnings of LIBRARY_WARNINGS (every other warning stays)."""
    for category, message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def main(argv: list[str]) -> int:
    """Run one sub-command; user errors print one line, never a traceback."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    quiet_library_warnings()
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
