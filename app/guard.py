"""The ASGI layer every request passes before any handler (the page, Gradio's API, /v1):
the Host and Origin checks of app/security.py, the only CORS answers the server gives, the
body cap and body read timeout, and the lockout after repeated failed logins or API keys.

Refusals are JSON in OpenAI's error shape, so API clients show them like any other error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders

from app.security import Limits, Policy, host_allowed, origin_allowed, same_origin

PREFLIGHT_MAX_AGE_S = 600  # browsers may cache an allowed origin's preflight this long
THROTTLED = ("/login", "/login/", "/v1/")  # where failed credentials are counted (prefixes)


class _Refused(Exception):
    """A request answered by the guard in the middle of reading its body."""


class Throttle:
    """Failed logins per client: after `limits.login_failures` within `limits.lockout_s`,
    the client is answered 429 for `limits.lockout_s`."""

    def __init__(self, limits: Limits, clock: Callable[[], float]):
        self.limits, self.clock = limits, clock
        self._failures: dict[str, list[float]] = {}  # client -> times of recent failures
        self._locked: dict[str, float] = {}  # client -> when its lockout ends

    def wait_s(self, client: str) -> float:
        """Seconds left of this client's lockout (0: not locked)."""
        left = self._locked.get(client, 0.0) - self.clock()
        if left <= 0:
            self._locked.pop(client, None)
        return max(left, 0.0)

    def failed(self, client: str) -> None:
        now = self.clock()
        recent = [t for t in self._failures.get(client, []) if now - t < self.limits.lockout_s]
        recent.append(now)
        if len(recent) >= self.limits.login_failures:
            self._locked[client] = now + self.limits.lockout_s
            recent = []
        self._failures[client] = recent
        if len(self._failures) > 10_000:  # many clients: forget the quiet ones
            self._failures = {c: f for c, f in self._failures.items() if f}

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


class Guard:
    """Wraps the whole app: nothing reaches a route unless this admits it."""

    def __init__(self, app, policy: Policy, clock: Callable[[], float] = time.monotonic):
        self.app, self.policy = app, policy
        self.throttle = Throttle(policy.limits, clock)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
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
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        if foreign and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(origin, headers, send)
            return
        await self._http(scope, receive, send, headers, origin if foreign else None)

    async def _http(self, scope, receive, send, headers: Headers, echo: str | None) -> None:
        limits = self.policy.limits
        client = (scope.get("client") or ("?", 0))[0]
        counted = scope["path"].startswith(THROTTLED)
        if counted and (wait := self.throttle.wait_s(client)):
            await _refuse(scope, send, 429, "too many failed logins or API keys: wait before "
                          "trying again", {"retry-after": str(int(wait) + 1)})
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limits.max_body_bytes:
            await _refuse(scope, send, 413, _too_large(limits))
            return
        state = {"read": 0, "done": False, "started": False, "refused": False}

        async def guarded_receive():
            if state["done"]:
                return await receive()  # after the body: waits for a disconnect
            try:
                message = await asyncio.wait_for(receive(), limits.body_timeout_s)
            except asyncio.TimeoutError:
                await refuse(408, f"no request body arrived for {limits.body_timeout_s:g} s")
            if message["type"] != "http.request" or not message.get("more_body"):
                state["done"] = True
            state["read"] += len(message.get("body", b""))
            if state["read"] > limits.max_body_bytes:
                await refuse(413, _too_large(limits))
            return message

        async def refuse(status: int, text: str):
            if not state["started"]:
                state["started"] = True
                await _refuse(scope, send, status, text)
            state["refused"] = True
            raise _Refused

        async def guarded_send(message) -> None:
            if state["refused"]:
                return  # the guard has answered: whatever the app says next is dropped
            if message["type"] == "http.response.start":
                state["started"] = True
                _cors(message, echo)
                if counted:
                    self._count(client, scope["path"], message["status"])
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except _Refused:
            pass
        except Exception:
            if not state["refused"]:
                raise

    def _count(self, client: str, path: str, status: int) -> None:
        if status == 401 or (status == 400 and path.startswith("/login")):
            self.throttle.failed(client)
        elif status < 300:
            self.throttle.succeeded(client)


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
                                 "code": {403: "forbidden", 408: "request_timeout",
                                          413: "request_too_large", 429: "rate_limited"}[status]}})
    head = {"content-type": "application/json", "content-length": str(len(body)),
            "connection": "close", **(extra or {})}
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in head.items()]})
    await send({"type": "http.response.body", "body": body.encode()})
