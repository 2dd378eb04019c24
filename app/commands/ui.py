"""The bare command: the app in the browser, served on 127.0.0.1."""

from __future__ import annotations

import argparse

from engine.config import QUANT_CHOICES, ModelSpec

HELP = "start the app in the browser (the default when no command is given)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to serve on (default 127.0.0.1; any other address "
                             "needs --auth)")
    parser.add_argument("--port", type=int, default=None,
                        help="port (default 7860, or the next free one when it is taken)")
    parser.add_argument("--auth", metavar="USER:PASSWORD",
                        help="require this login (mandatory with a non-loopback --host)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    parser.add_argument("--model", default=None,
                        help="model to start with: 'default', a local folder or a repo id "
                             "(default: the last one used)")
    parser.add_argument("--quant", default="auto", choices=QUANT_CHOICES)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow code shipped with the --model to run (off by default)")


def run(args: argparse.Namespace) -> int:
    from app.ui.launch import LaunchOptions, launch, parse_auth

    model = None
    if args.model is not None:
        model = ModelSpec(source=args.model, quant=args.quant,
                          trust_remote_code=args.trust_remote_code)
    options = LaunchOptions(host=args.host, port=args.port, auth=parse_auth(args.auth),
                            open_browser=not args.no_browser, model=model)
    launch(options, block=True)
    return 0
