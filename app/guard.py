"""The ASGI layer every request passes before any handler (the page, Gradio's API, /v1):
the Host and Origin checks of app/security.py (and, for a request without an Origin, its
Sec-Fetch-Site and Referer), the only CORS answers the server gives, the headers that keep
other sites from framing the page, the body cap and body deadline, the upload caps, and the
lockout after repeated failed logins or API keys.

The client a lockout counts is the connection's own address: uvicorn reads X-Forwarded-For
only from the proxies the command line names (--trusted-proxy; app/ui/launch.py), so a
client cannot pick a new address per guess.

Refusals are JSON in OpenAI's error shape, so API clients show them like any other error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from python_multipart.multipart import parse_options_header
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request

from app.security import (
    Limits,
    Policy,
    bearer_token,
    host_allowed,
    origin_allowed,
    referer_origin,
    same_origin,
)

PREFLIGHT_MAX_AGE_S = 600  # browsers may cache an allowed origin's preflight this long
THROTTLED = ("/login", "/login/", "/v1/")  # where failed credentials are counted (prefixes)
UPLOAD_PATH = "/gradio_api/upload"  # Gradio's file uploads: the page's prompts file
ACCEPTED_KEPT = 64  # credentials remembered as accepted (only right ones ever are)
SINGLE = (b"host", b"origin")  # headers a request may carry once: two leave "which?" open
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")  # requests that change nothing (a link, a preflight)


class _Refused(Exception):
    """A request answered by the guard in the middle of reading its body."""


class Throttle:
    """Failed logins and API keys per client address, each kind counted apart: after
    `limits.login_failures` of one kind within `limits.lockout_s`, the address is answered
    429 for that kind for `limits.lockout_s`, except for a credential this server has
    accepted before. Every local program shares 127.0.0.1, so without that exception five
    wrong guesses from any of them would lock the user out of the key and login in use; a
    guess never accepted still waits, so guessing stays slow."""

    def __init__(self, limits: Limits, clock: Callable[[], float]):
        self.limits, self.clock = limits, clock
        # (client, kind) -> times of recent failures; kind: "key" or "login"
        self._failures: dict[tuple[str, str], list[float]] = {}
        self._locked: dict[tuple[str, str], float] = {}  # (client, kind) -> lockout's end
        self._salt = secrets.token_bytes(16)  # no secret is kept in memory as itself
        self._accepted: dict[bytes, None] = {}  # digests of accepted credentials, oldest first

    def wait_s(self, client: str, kind: str, credential: bytes | None) -> float:
        """Seconds left of this client's lockout for `credential` (0: may try)."""
        if credential is not None and self._digest(credential) in self._accepted:
            return 0.0
        left = self._locked.get((client, kind), 0.0) - self.clock()
        if left <= 0:
            self._locked.pop((client, kind), None)
        return max(left, 0.0)

    def failed(self, client: str, kind: str) -> None:
        now, who = self.clock(), (client, kind)
        recent = [t for t in self._failures.get(who, []) if now - t < self.limits.lockout_s]
        recent.append(now)
        if len(recent) >= self.limits.login_failures:
            self._locked[who] = now + self.limits.lockout_s
            recent = []
        self._failures[who] = recent
        if len(self._failures) > 10_000:  # many clients: forget the quiet ones
            self._failures = {c: f for c, f in self._failures.items() if f}

    def succeeded(self, credential: bytes | None) -> None:
        """Remember `credential` as accepted. The client's failures stay counted: the user's
        own successes between someone's guesses must not reset the count for ever."""
        if credential is None:
            return
        self._accepted[self._digest(credential)] = None
        while len(self._accepted) > ACCEPTED_KEPT:  # a server with no key accepts any
            del self._accepted[next(iter(self._accepted))]

    def _digest(self, credential: bytes) -> bytes:
        return hashlib.sha256(self._salt + credential).digest()


class Guard:
    """Wraps the whole app: nothing reaches a route unless this admits it."""

    def __init__(self, app, policy: Policy, clock: Callable[[], float] = time.monotonic,
                 uploads: Path | None = None):
        self.app, self.policy = app, policy
        self.uploads = uploads  # the folder uploads land in (its total is capped); None: none
        self.throttle = Throttle(policy.limits, clock)
        # who may show the page inside theirs: itself and the origins allowed to call it
        ancestors = " ".join(["'self'", *sorted(o for o in policy.origins if o != "null")])
        self.frame_headers = {"content-security-policy": f"frame-ancestors {ancestors}",
                              "x-frame-options": "SAMEORIGIN"}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        repeated = [k for k, _ in scope["headers"] if k in SINGLE]
        if len(repeated) != len(set(repeated)):
            await _refuse(scope, send, 400, "the request carries more than one Host or Origin "
                          "header: send each once")
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not host_allowed(self.policy, host):
            await _refuse(scope, send, 403, f"this server does not answer to the host name "
                          f"{host!r}: start it with --allowed-host NAME to allow it")
            return
        origin = headers.get("origin")
        foreign = origin is not None and not same_origin(origin, _scheme(scope), host)
        if foreign and not origin_allowed(self.policy, origin):
            await _refuse(scope, send, 403, f"requests from the web origin {origin!r} are not "
                          "allowed: start the server with --allowed-origin ORIGIN to allow it")
            return
        if origin is None and (why := self._other_site(scope, headers, host)):
            await _refuse(scope, send, 403, why)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        if foreign and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(origin, headers, send)
            return
        await self._http(scope, receive, send, headers, origin if foreign else None)

    def _other_site(self, scope, headers: Headers, host: str) -> str | None:
        """Why a request without an Origin is refused as another site's, or None. Browsers
        name the requesting site in Sec-Fetch-Site (all of today's) and Referer: a page of
        another site may follow a link here (a navigation), nothing else. Clients that send
        neither (curl, the openai client, editors) are unaffected."""
        method = scope.get("method", "GET")
        navigation = method in ("GET", "HEAD") and headers.get("sec-fetch-mode") == "navigate"
        site = headers.get("sec-fetch-site", "")
        if site in ("cross-site", "same-site") and not navigation:
            return (f"a request sent by another site (Sec-Fetch-Site: {site}) without an "
                    "Origin is refused")
        referer = headers.get("referer")
        if referer is not None and method not in SAFE_METHODS:
            origin = referer_origin(referer)
            if not same_origin(origin, _scheme(scope), host) and \
                    not origin_allowed(self.policy, origin):
                return "a request sent from another site's page (its Referer) is refused"
        return None

    async def _http(self, scope, receive, send, headers: Headers, echo: str | None) -> None:
        limits = self.policy.limits
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limits.max_body_bytes:
            await _refuse(scope, send, 413, _too_large(limits))
            return
        body = _Body(receive, limits, scope, send)
        client = (scope.get("client") or ("?", 0))[0]
        counted = scope["path"].startswith(THROTTLED)
        kind = "login" if scope["path"].startswith("/login") else "key"
        credential = None

        async def guarded_send(message) -> None:
            if body.refused:
                return  # the guard has answered: whatever the app says next is dropped
            if message["type"] == "http.response.start":
                body.started = True
                _cors(message, echo)
                MutableHeaders(scope=message).update(self.frame_headers)
                if counted:
                    self._count(client, kind, message["status"], credential)
            await send(message)

        try:
            if counted:
                credential = await _credential(scope, headers, body)
                if wait := self.throttle.wait_s(client, kind, credential):
                    await body.refuse(429, "too many failed logins or API keys: wait before "
                                      "trying again", {"retry-after": str(int(wait) + 1)})
            if scope["path"] == UPLOAD_PATH:
                await _check_upload(headers, body, limits, self.uploads)
            await self.app(scope, body.receive, guarded_send)
        except _Refused:
            pass
        except Exception:
            if not body.refused:
                raise

    def _count(self, client: str, kind: str, status: int, credential: bytes | None) -> None:
        if status == 401 or (status == 400 and kind == "login"):
            self.throttle.failed(client, kind)
        elif status < 300:
            self.throttle.succeeded(credential)


class _Body:
    """The request body as the app reads it: capped at `limits.max_body_bytes` and due in
    full within `limits.body_timeout_s` of its first read, else refused (413, 408). The
    guard may read it first (`read_all`): the app then reads the same messages again."""

    def __init__(self, receive, limits: Limits, scope, send):
        self._receive, self.limits, self._scope, self._send = receive, limits, scope, send
        self.read, self.done, self.started, self.refused = 0, False, False, False
        self._deadline: float | None = None
        self._kept: list[dict] = []  # messages read by the guard, for the app to read again

    async def receive(self):
        if self._kept:
            return self._kept.pop(0)
        return await self._read()

    async def read_all(self) -> bytes:
        """The whole body, kept for the app (at most `max_body_bytes`)."""
        while not self.done:
            self._kept.append(await self._read())
        return b"".join(m.get("body", b"") for m in self._kept)

    async def _read(self):
        if self.done:
            return await self._receive()  # after the body: waits for a disconnect
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + self.limits.body_timeout_s
        try:
            message = await asyncio.wait_for(self._receive(), self._deadline - loop.time())
        except asyncio.TimeoutError:
            await self.refuse(408, f"the request body did not arrive within "
                              f"{self.limits.body_timeout_s:g} s")
        if message["type"] != "http.request" or not message.get("more_body"):
            self.done = True
        self.read += len(message.get("body", b""))
        if self.read > self.limits.max_body_bytes:
            await self.refuse(413, _too_large(self.limits))
        return message

    async def refuse(self, status: int, text: str, extra: dict | None = None):
        if not self.started:
            self.started = True
            await _refuse(self._scope, self._send, status, text, extra)
        self.refused = True
        raise _Refused


async def _credential(scope, headers: Headers, body: _Body) -> bytes | None:
    """What a throttled request presents, as the route reads it (bearer_token: `bearer KEY`
    and `Bearer  KEY` are the same key): the login's user and password, or the API key; the
    kind goes first, so that a value accepted as one is never trusted as the other.
    None: a login form this cannot read (never remembered, always subject to lockouts)."""
    if not scope["path"].startswith("/login"):
        given = headers.get("authorization", "")
        key = bearer_token(given)
        return b"key\n" + (key if key is not None else " ".join(given.split())).encode()
    if scope["method"] != "POST":
        return None
    raw = await body.read_all()
    kept = iter([{"type": "http.request", "body": raw}])

    async def replay():
        return next(kept, {"type": "http.disconnect"})

    try:  # read as the login route reads it (FastAPI's form limits)
        async with Request(scope, replay).form() as form:
            user, password = form.get("username"), form.get("password")
    except Exception:  # unreadable: the login route answers it
        return None
    if not isinstance(user, str) or not isinstance(password, str):
        return None
    return f"login\n{user.strip()}:{password}".encode(errors="surrogatepass")


async def _check_upload(headers: Headers, body: _Body, limits: Limits,
                        folder: Path | None) -> None:
    """Refuse, before any file is written, an upload of more than `limits.upload_files`
    files (its size is the body cap's), or one that would take the upload `folder` past
    `limits.uploads_bytes` or `limits.uploads_count` files. Parts are counted by their
    delimiter lines."""
    boundary = _boundary(headers.get("content-type", ""))
    if boundary is None:
        return  # not multipart: Gradio refuses it
    raw = await body.read_all()
    parts = (b"\r\n" + raw).count(b"\r\n--" + boundary) - 1  # the last one closes
    if parts > limits.upload_files:
        await body.refuse(413, f"an upload takes at most {limits.upload_files} files "
                          f"({parts} sent)")
    if folder is None:
        return
    count, size = _held(folder)
    if count + parts > limits.uploads_count or size + len(raw) > limits.uploads_bytes:
        await body.refuse(413, f"the upload folder holds {count} files ("
                          f"{size / 2**20:.1f} MiB) already, the most this app keeps: "
                          "restart it to clear the uploads of earlier runs, or wait a day")


def _held(folder: Path) -> tuple[int, int]:
    """Files under `folder` and their bytes (links and what vanishes meanwhile skipped)."""
    count = size = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                found = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            count, size = count + 1, size + found.st_size
    return count, size


def _boundary(content_type: str) -> bytes | None:
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    return boundary if kind == b"multipart/form-data" and boundary else None


def _scheme(scope) -> str:
    return {"ws": "http", "wss": "https"}.get(scope.get("scheme", "http"), scope.get("scheme"))


def _too_large(limits: Limits) -> str:
    return (f"the request body is larger than {limits.max_body_bytes / 2**20:g} MiB "
            "(start the server with --max-body-mb to change the cap)")


def _cors(message, echo: str | None) -> None:
    """Only the guard decides cross-origin access: drop what the app set, allow `echo`."""
    headers = MutableHeaders(scope=message)
    for name in [k for k in headers.keys() if k.startswith("access-control-")]:
        del headers[name]
    if echo is not None:
        headers["access-control-allow-origin"] = echo
        headers.add_vary_header("Origin")


async def _preflight(origin: str, headers: Headers, send) -> None:
    allow = {"access-control-allow-origin": origin,
             "access-control-allow-methods": "GET, POST, OPTIONS",
             "access-control-allow-headers": headers.get("access-control-request-headers",
                                                         "authorization, content-type"),
             "access-control-max-age": str(PREFLIGHT_MAX_AGE_S), "vary": "Origin"}
    await send({"type": "http.response.start", "status": 204,
                "headers": [(k.encode(), v.encode()) for k, v in allow.items()]})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(scope, send, status: int, message: str, extra: dict | None = None) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": {400: "invalid_request", 403: "forbidden",
                                          408: "request_timeout", 413: "request_too_large",
                                          429: "rate_limited"}[status]}})
    head = {"content-type": "application/json", "content-length": str(len(body)),
            "connection": "close", **(extra or {})}
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in head.items()]})
    await send({"type": "http.response.body", "body": body.encode()})
