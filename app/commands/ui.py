"""The bare command: the app in the browser, served on 127.0.0.1, with its OpenAI-compatible
API at /v1 on the same port."""

from __future__ import annotations

import argparse
import math
import os

from app.commands.common import add_model_args, model_spec
from app.security import DEFAULT_REPLY_CAP, Limits
from engine.config import ModelSpec
from engine.errors import QuickdraftError

HELP = "start the app in the browser (the default when no command is given)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to serve on (default 127.0.0.1; any other address "
                             "needs --auth and --api-key)")
    parser.add_argument("--port", type=int, default=None,
                        help="port (default 7860, or the next free one when it is taken)")
    parser.add_argument("--auth", metavar="USER:PASSWORD",
                        help="require this login (mandatory with a non-loopback --host; "
                             "or --auth-file, or env QUICKDRAFT_AUTH)")
    parser.add_argument("--auth-file", metavar="PATH", default=None,
                        help="read USER:PASSWORD from this file (kept out of the process list)")
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help="require 'Authorization: Bearer KEY' on the /v1 API (mandatory "
                             "with a non-loopback --host; or --api-key-file, or env "
                             "QUICKDRAFT_API_KEY)")
    parser.add_argument("--api-key-file", metavar="PATH", default=None,
                        help="read the API key from this file (kept out of the process list)")
    parser.add_argument("--allowed-host", metavar="NAME", action="append", default=[],
                        help="also answer requests sent to this host name (repeatable; "
                             "loopback names and the --host address always are)")
    parser.add_argument("--allowed-origin", metavar="ORIGIN", action="append", default=[],
                        help="let web pages from this origin, e.g. http://localhost:3000, call "
                             "the server (repeatable; or env QUICKDRAFT_ORIGINS, "
                             "comma-separated)")
    parser.add_argument("--max-body-mb", type=float, default=Limits().max_body_bytes / 2**20,
                        help="largest request body accepted, in MiB (default %(default)g)")
    parser.add_argument("--max-reply-tokens", type=int, default=DEFAULT_REPLY_CAP,
                        help="longest API reply when a request sets no max_tokens (it runs to "
                             "the context's end or its stop otherwise; default %(default)s)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    add_model_args(parser, start=True)


def run(args: argparse.Namespace, open_browser: bool | None = None) -> int:
    from app.credentials import API_KEY_ENV, AUTH_ENV, secret
    from app.ui.launch import LaunchOptions, launch, parse_auth

    if args.trust_remote_code and args.model is None:
        raise QuickdraftError("--trust-remote-code applies to the model named by --model: "
                              "add --model NAME")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):  # "inf" parses
        raise QuickdraftError("--max-body-mb must be a positive number")
    if args.max_reply_tokens < 1:
        raise QuickdraftError("--max-reply-tokens must be a positive number")
    model = model_spec(args) or _last_model_as_asked(args)
    if open_browser is None:
        open_browser = not args.no_browser
    auth = secret("auth", args.auth, args.auth_file, AUTH_ENV, os.environ)
    api_key = secret("api-key", args.api_key, args.api_key_file, API_KEY_ENV, os.environ)
    limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20))
    options = LaunchOptions(host=args.host, port=args.port, auth=parse_auth(auth),
                            open_browser=open_browser, model=model, api_key=api_key,
                            allowed_hosts=tuple(args.allowed_host),
                            allowed_origins=tuple(args.allowed_origin), limits=limits,
                            step=args.step, max_reply_tokens=args.max_reply_tokens)
    launch(options, block=True)
    return 0


def _last_model_as_asked(args: argparse.Namespace) -> ModelSpec | None:
    """--quant or --requantize without --model: the last model used, loaded as they ask
    (None when neither is given: the last model as it was last loaded)."""
    if args.quant == "auto" and not args.requantize:
        return None
    from app.store import Store

    return ModelSpec(source=Store().load_settings().model, quant=args.quant,
                     requantize=args.requantize)
