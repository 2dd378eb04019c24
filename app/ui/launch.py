"""Serve the app and its OpenAI-compatible API: loopback by default, a free port, a login and
an API key whenever they are reachable from other machines, never a public share link."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from app.http_timeouts import install_head_timeout
from app.security import DEFAULT_REPLY_CAP, Limits, Policy, make_policy
from app.uploads import use_upload_folder
from engine.config import ModelSpec
from engine.errors import QuickdraftError

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
PORT_TRIES = 100  # when the default port is taken, the next free one of this many is used
FORWARDED_ENV = "FORWARDED_ALLOW_IPS"  # uvicorn's list of proxies it believes


@dataclass(frozen=True)
class LaunchOptions:
    """How the app is served."""

    host: str = DEFAULT_HOST  # address to listen on; anything but loopback needs `auth`
    port: int | None = None  # None: DEFAULT_PORT, or the next free port when it is taken
    auth: tuple[str, str] | None = None  # (user, password) asked by Gradio's login page
    open_browser: bool = True  # open the page in the default browser once it is up
    model: ModelSpec | None = None  # None: the last model used, else the bundled one
    api_key: str | None = None  # the /v1 API's "Authorization: Bearer" key; needed off loopback
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides loopback and `host`
    allowed_origins: tuple[str, ...] = ()  # web origins allowed to call (plus QUICKDRAFT_ORIGINS)
    limits: Limits = Limits()  # body cap, timeouts, login lockout
    step: str = "auto"  # how decode steps run for every model loaded (engine/config.py)
    max_reply_tokens: int = DEFAULT_REPLY_CAP  # an API reply's length when it sets none
    # addresses of the reverse proxies whose X-Forwarded-For / -Proto headers are believed
    # (--trusted-proxy); none by default: a client could name any address per request
    trusted_proxies: tuple[str, ...] = ()


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, auth: tuple[str, str] | None, api_key: str | None = "") -> None:
    """Refuse to serve beyond this machine without a login for the page and a key for the
    API. (api_key="" skips the key check, for callers that serve no API.)"""
    if is_loopback(host):
        return
    if auth is None:
        raise QuickdraftError(
            f"--host {host} makes the app reachable from other machines: add "
            "--auth USER:PASSWORD to require a login, or leave --host out to stay on 127.0.0.1"
        )
    if api_key is None:
        raise QuickdraftError(
            f"--host {host} makes the API reachable from other machines: add --api-key KEY "
            "(clients send it as 'Authorization: Bearer KEY'), or leave --host out"
        )


def check_api_key(key: str | None) -> str | None:
    if key is not None and (len(key) < 8 or any(c.isspace() for c in key)):
        raise QuickdraftError("--api-key needs at least 8 characters and no spaces")
    return key


def parse_auth(text: str | None) -> tuple[str, str] | None:
    """'user:password' -> (user, password)."""
    if text is None:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise QuickdraftError("--auth takes USER:PASSWORD (both non-empty)")
    return user, password


def pick_port(host: str, port: int | None) -> int:
    """`port` if given and free (else an error); otherwise the first free from 7860 on."""
    if port is not None:
        if not _free(host, port):
            raise QuickdraftError(f"port {port} on {host} is in use: pick another with --port")
        return port
    for candidate in range(DEFAULT_PORT, DEFAULT_PORT + PORT_TRIES):
        if _free(host, candidate):
            return candidate
    raise QuickdraftError(f"no free port in {DEFAULT_PORT}-{DEFAULT_PORT + PORT_TRIES - 1}: "
                          "pick one with --port")


def _free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def launch(options: LaunchOptions, block: bool = True):
    """Build the page and serve it with the API, the model loading behind it (its progress
    on the page's header and in the terminal). Not blocking: returns (Blocks, url, Service)
    once the model is loaded."""
    check_exposure(options.host, options.auth, check_api_key(options.api_key))
    port = pick_port(options.host, options.port)
    # A local app does not report usage anywhere (read when gradio is imported).
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    uploads = use_upload_folder()  # uploads in the app's cache folder, not /tmp/gradio
    from app.commands.progress_line import ProgressLine
    from app.service import Service
    from app.store import Store
    from app.ui.layout import build_app

    # What the start-up load and the compiled step's build are doing goes to the terminal
    # too: a line per stage or step, and every half minute meanwhile (the page's header
    # shows the same as it goes).
    service = Service.open(Store(), options.model, options.step, background=block,
                           echo=ProgressLine(sys.stderr, every_s=30.0, tty=False))
    demo = build_app(service)
    demo.queue(default_concurrency_limit=1)
    if not is_loopback(options.host):
        log.warning("serving on %s:%d: reachable from other machines, login required",
                    options.host, port)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    policy = make_policy(options.host, options.allowed_hosts, options.allowed_origins,
                         options.limits)
    app = _server_app(service, options, policy, uploads)  # guarded, with /v1, before serving
    with forwarded_from(options.trusted_proxies):
        # show_error off: a message reaches the page only as the one-line errors the page's
        # events raise (app/ui/guarded.py); monitoring off: no dashboard, no key in the log
        _app, url, _share = demo.launch(
            server_name=options.host, server_port=port, auth=options.auth, share=False,
            auth_message="Log in with the user and password given to --auth.",
            inbrowser=options.open_browser, prevent_thread_lock=True, show_error=False,
            enable_monitoring=False, **page_style(), footer_links=[], ssr_mode=False,
            quiet=True, _app=app,
        )
    install_head_timeout(demo.server.config, options.limits.header_timeout_s)
    print(f"Quickdraft is running at {url}  (Ctrl-C to quit)", flush=True)
    print(f"OpenAI-compatible API at {url.rstrip('/')}/v1"
          + (" (key required)" if options.api_key else ""), flush=True)
    if block:
        demo.block_thread()  # until Ctrl-C
        service.page_settings.flush()  # a setting typed just before quitting
        service.accels.writer.flush()  # the last reply's datastore record lands first
    return demo, url, service


def page_style() -> dict:
    """The theme, style sheet and script every launch of the page uses (tests' servers too)."""
    import gradio as gr

    from app.ui.style import CSS, RADIO_GROUPS

    theme = gr.themes.Soft(font=["ui-sans-serif", "system-ui", "sans-serif"],
                           font_mono=["ui-monospace", "monospace"])  # no web fonts: offline
    return {"theme": theme, "css": CSS, "js": RADIO_GROUPS}


@contextlib.contextmanager
def forwarded_from(proxies: tuple[str, ...]):
    """While the server is created: uvicorn believes X-Forwarded-For and -Proto only from
    `proxies` (it reads FORWARDED_ALLOW_IPS then, and believes loopback by default, so any
    local program could name a new client address per request and never be locked out).
    Nothing matches an empty entry: no proxy is believed."""
    before = os.environ.get(FORWARDED_ENV)
    os.environ[FORWARDED_ENV] = ",".join(proxies)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FORWARDED_ENV, None)
        else:
            os.environ[FORWARDED_ENV] = before


def _server_app(service, options: LaunchOptions, policy: Policy, uploads: Path | None = None):
    """The FastAPI app Gradio serves, built here so the guard wraps every route and the /v1
    routes answer from the first request on. No schema pages: they would bypass the login."""
    from fastapi.responses import JSONResponse
    from gradio.routes import App, CustomCORSMiddleware, ORJSONResponse

    from app.api import ApiOptions, mount
    from app.guard import Guard

    class GuardedApp(App):
        def build_middleware_stack(self):
            # the guard alone answers cross-origin requests (Gradio's own CORS layer echoes
            # any localhost origin with credentials)
            self.user_middleware = [m for m in self.user_middleware
                                    if m.cls is not CustomCORSMiddleware]
            return Guard(super().build_middleware_stack(), policy, uploads=uploads)

    app = GuardedApp(default_response_class=ORJSONResponse, openapi_url=None, docs_url=None,
                     redoc_url=None)
    mount(app, service, ApiOptions(api_key=options.api_key,
                                   max_reply_tokens=options.max_reply_tokens))

    # Gradio serves its own OpenAPI schema under /gradio_api; a route added before Gradio
    # adds its own answers that path with 404 instead.
    @app.get("/gradio_api/openapi.json", include_in_schema=False)
    def no_schema():
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    return app
