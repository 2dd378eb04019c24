"""`train`: build an accelerator for a model from the command line, with a progress bar."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import traceback
from pathlib import Path

from app.commands.common import add_model_args, load
from app.commands.progress_line import ProgressLine
from app.jobs import one_line
from app.store import Store
from engine.drafters.registry import TRAINED, method
from engine.errors import QuickdraftError
from engine.paths import data_dir

HELP = "build an accelerator (self-distilled data, training, calibration) for a model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method", required=True, choices=TRAINED, help="which accelerator to build"
    )
    add_model_args(parser)
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help='extra seed prompts: JSONL with {"prompt": ...} per line, or plain text lines',
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=20.0,
        help="time budget for the whole job, data generation included (default 20)",
    )
    parser.add_argument(
        "--no-chats",
        action="store_true",
        help="do not learn from your stored chats with this model (by default the model's "
        "own replies there are training data; they never leave this computer)",
    )
    parser.add_argument(
        "--continue",
        dest="continue_training",
        action="store_true",
        help="start from the accelerator already trained for this model instead of from "
        "nothing (a fresh start, with a notice, when there is none that fits)",
    )


def run(args: argparse.Namespace) -> int:
    from trainer.pipeline import options_for, train_accelerator

    # Check the options before the model loads, so a typo fails at once.
    options = options_for(args.method, args.max_minutes, args.prompts,
                          continue_training=args.continue_training)
    lm = load(args, "watch")  # ready long before calibration times it
    if not args.no_chats:
        options = dataclasses.replace(options, chats=tuple(Store().chats_with(lm.fingerprint)))
    bar = ProgressLine(sys.stderr)
    try:
        result = train_accelerator(lm, options, bar)
    except KeyboardInterrupt:
        result = None
    except QuickdraftError:
        raise
    except Exception as exc:  # a model outside the tested envelope: one line, details logged
        raise QuickdraftError(f"training failed: {one_line(exc)} (details in {_log(exc)})") from exc
    finally:
        bar.close()
    if result is None:
        print(
            "interrupted: run the same command again to resume (the data and features are kept)",
            file=sys.stderr,
        )
        return 130
    print(summary(result), flush=True)
    return 0


def _log(exc: Exception) -> Path:
    """Write the traceback where a bug report can quote it; returns the file."""
    path = data_dir() / "logs" / "train-error.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
    return path


def summary(result) -> str:
    """What was built and whether it pays, for people."""
    if result.cancelled:
        return ("cancelled: run the same command again to resume (the accelerator trained "
                "before is unchanged)")
    m, s = result.metrics, result.settings
    lines = [
        f"{result.method} accelerator saved to {result.folder}",
        f"data: {result.data.get('conversations')} conversations, "
        f"{result.data.get('tokens')} answer tokens",
        f"{result.data.get('chat_conversations', 0)} conversations from your chats "
        "(learned from, never held out)",
    ]
    continued = result.metrics.get("continued")
    if continued:
        lines += [f"continued from {continued['from']}:",
                  *(f"  {line}" for line in continued["modules"])]
    times = m.get("times", {})
    if times:
        lines.append(
            "time: " + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in times.items())
        )
    lines += importlib.import_module(method(result.method).trainer).summary_lines(m, s)
    return "\n".join(lines)
