"""The bare command: the app in the browser, served on 127.0.0.1, with its OpenAI-compatible
API at /v1 on the same port."""

from __future__ import annotations

import argparse

from app.commands.common import gguf_source
from engine.config import QUANT_CHOICES, ModelSpec

HELP = "start the app in the browser (the default when no command is given)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to serve on (default 127.0.0.1; any other address "
                             "needs --auth and --api-key)")
    parser.add_argument("--port", type=int, default=None,
                        help="port (default 7860, or the next free one when it is taken)")
    parser.add_argument("--auth", metavar="USER:PASSWORD",
                        help="require this login (mandatory with a non-loopback --host)")
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help="require 'Authorization: Bearer KEY' on the /v1 API (mandatory "
                             "with a non-loopback --host)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    parser.add_argument("--model", default=None,
                        help="model to start with: 'default', a local folder, a .gguf file, "
                             "a repo id or REPO:FILE.gguf (default: the last one used)")
    parser.add_argument("--gguf-file", metavar="NAME", default=None,
                        help="with a repo id as --model: the GGUF file of that repo to use")
    parser.add_argument("--quant", default="auto", choices=QUANT_CHOICES)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow code shipped with the --model to run (off by default)")


def run(args: argparse.Namespace, open_browser: bool | None = None) -> int:
    from app.ui.launch import LaunchOptions, launch, parse_auth

    model = None
    if args.model is not None:
        model = ModelSpec(source=gguf_source(args.model, args.gguf_file), quant=args.quant,
                          trust_remote_code=args.trust_remote_code)
    if open_browser is None:
        open_browser = not args.no_browser
    options = LaunchOptions(host=args.host, port=args.port, auth=parse_auth(args.auth),
                            open_browser=open_browser, model=model, api_key=args.api_key)
    launch(options, block=True)
    return 0
