"""`bench` sub-command."""

from __future__ import annotations

import argparse

from engine.errors import QuickdraftError

HELP = "bench (not available in this build)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs="*")


def run(args: argparse.Namespace) -> int:
    raise QuickdraftError("'bench' is not available in this build yet")
