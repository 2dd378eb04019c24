"""The bare command: until the Gradio app is wired in, an interactive terminal chat."""

from __future__ import annotations

import argparse

from app.commands import chat

HELP = "start the app (the default when no command is given)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    chat.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    args.prompt = None
    return chat.run(args)
