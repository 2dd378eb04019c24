"""Who may talk to the server: which Host names it answers, which other web origins may
call it, and the limits every request lives within. Pure functions over a `Policy`; the
ASGI guard (app/guard.py) applies them to each request before any handler runs.

Why a Host check: a web page on a name its owner controls can re-point that name at
127.0.0.1 (DNS rebinding); the browser then treats the app as that page's own origin. Such
requests still carry the attacker's name in `Host`, so only names the user chose are served.
An address typed as digits cannot be re-pointed, so it is safe wherever the app listens.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ORIGINS_ENV = "QUICKDRAFT_ORIGINS"  # comma-separated origins allowed besides the page's own
LOOPBACK_NAMES = ("localhost",)  # plus every loopback address and any *.localhost name
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
# A prompt longer than this many characters per token of the model's context cannot fit
# whatever its tokens: refused before the tokenizer spends seconds on megabytes of text.
PROMPT_CHARS_PER_TOKEN = 16


def prompt_too_long(chars: int, context_len: int) -> str | None:
    """Why a prompt of `chars` characters is refused for this context; None if it is not."""
    limit = PROMPT_CHARS_PER_TOKEN * context_len
    if chars <= limit:
        return None
    return (f"the prompt holds {chars:,} characters: far more than this model's "
            f"{context_len:,}-token context (at most {limit:,} characters are accepted)")


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server."""

    max_body_bytes: int = 4 * 2**20  # larger bodies are answered 413 (--max-body-mb)
    header_timeout_s: float = 10.0  # a request head not complete by then: connection closed
    body_timeout_s: float = 30.0  # no body bytes for this long: 408 and closed
    login_failures: int = 5  # failed logins or API keys per client before a lockout
    lockout_s: float = 60.0  # how long such a client is answered 429


@dataclass(frozen=True)
class Policy:
    """The Host names, origins and limits of one server."""

    hosts: frozenset[str]  # Host names and addresses served (lower case, no port)
    any_address: bool  # listening on every interface: any address typed as digits is served
    origins: frozenset[str] = frozenset()  # other origins allowed to call, normalised
    limits: Limits = field(default_factory=Limits)


def make_policy(host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (),
                allowed_origins: Iterable[str] = (), limits: Limits | None = None,
                environ: Mapping[str, str] | None = None) -> Policy:
    """The policy of a server listening on `host`, with the user's extra names and origins
    (from flags and from QUICKDRAFT_ORIGINS)."""
    environ = os.environ if environ is None else environ
    names = {_bare(host), *(_bare(h) for h in allowed_hosts)}
    any_address = _is_unspecified(host)
    if any_address:  # reached by this machine's own name too
        names |= {socket.gethostname().lower(), f"{socket.gethostname().lower()}.local"}
    names.discard("")
    origins = [*allowed_origins, *environ.get(ORIGINS_ENV, "").split(",")]
    return Policy(frozenset(names), any_address,
                  frozenset(o for o in map(normalise_origin, origins) if o), limits or Limits())


def host_allowed(policy: Policy, host_header: str | None) -> bool:
    """Is `Host: host_header` one of the names this server answers to?"""
    if not host_header:
        return False  # HTTP/1.1 requires it; a browser always sends it
    name = _bare(split_host(host_header)[0])
    if name in LOOPBACK_NAMES or name.endswith(".localhost") or name in policy.hosts:
        return True
    address = _address(name)
    return address is not None and (address.is_loopback or policy.any_address)


def same_origin(origin: str, scheme: str, host_header: str) -> bool:
    """Is `origin` the page's own: the scheme, host and port this request was sent to?"""
    name, port = split_host(host_header)
    own = f"{scheme}://{name}" + (f":{port}" if port is not None else "")
    return normalise_origin(origin) == normalise_origin(own)


def origin_allowed(policy: Policy, origin: str) -> bool:
    """Is `origin` one the user allowed to call this server from its pages?"""
    return normalise_origin(origin) in policy.origins


def normalise_origin(origin: str) -> str:
    """'HTTP://LocalHost:80/' -> 'http://localhost'; "null" stays; junk -> ""."""
    origin = origin.strip().rstrip("/").lower()
    if origin == "null":
        return origin
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return ""
    if not parts.scheme or not parts.hostname or parts.path or parts.query:
        return ""
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if port is not None and port != DEFAULT_PORTS.get(parts.scheme):
        host += f":{port}"
    return f"{parts.scheme}://{host}"


def split_host(host_header: str) -> tuple[str, int | None]:
    """'example.com:80' -> ('example.com', 80); '[::1]:7860' -> ('[::1]', 7860)."""
    host, _, port = host_header.strip().rpartition(":")
    if not host or "]" in port or (host.count(":") and not host.startswith("[")):
        return host_header.strip(), None  # no port, or a bare IPv6 address
    return host, int(port) if port.isdigit() else None


def _bare(name: str) -> str:
    return name.strip().lower().strip("[]").rstrip(".")


def _address(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _is_unspecified(host: str) -> bool:
    address = _address(_bare(host))
    return address is not None and address.is_unspecified
