"""`serve`: the app and its OpenAI-compatible API without opening a browser (headless use)."""

from __future__ import annotations

import argparse

from app.commands import ui

HELP = "serve the OpenAI-compatible API (and the page) without opening a browser"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ui.add_arguments(parser)  # the same flags as the app


def run(args: argparse.Namespace) -> int:
    return ui.run(args, open_browser=False)
