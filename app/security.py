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
import re
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
# A Host header is a name (letters, digits, '.', '-', '_') or an IPv6 address in brackets,
# then an optional numeric port; nothing else. Lenient parsing would let 'evil.com#.localhost'
# pass as a *.localhost name, or 'localhost:evil' as localhost.
HOST_HEADER = re.compile(r"(?P<name>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>[0-9]{1,5}))?")


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
    # the whole body must arrive within this long of its first read, however it trickles
    # (a byte a second would reset an idle timer for ever): 408 and closed
    body_timeout_s: float = 30.0
    login_failures: int = 5  # failed logins or API keys per client before a lockout
    lockout_s: float = 60.0  # how long such a client's new credentials are answered 429
    upload_files: int = 4  # files in one upload request (the page sends one at a time)
    # what the upload folder may hold in all (uploads, and Gradio's copies of downloads):
    # an upload that would pass either is refused (413) before a byte of it is written
    uploads_bytes: int = 64 * 2**20
    uploads_count: int = 128


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
    address = _address(_bare(host))
    any_address = address is not None and address.is_unspecified
    if any_address:  # reached by this machine's own name too
        names |= {socket.gethostname().lower(), f"{socket.gethostname().lower()}.local"}
    names.discard("")
    origins = [*allowed_origins, *environ.get(ORIGINS_ENV, "").split(",")]
    return Policy(frozenset(names), any_address,
                  frozenset(o for o in map(normalise_origin, origins) if o), limits or Limits())


def host_allowed(policy: Policy, host_header: str | None) -> bool:
    """Is `Host: host_header` one of the names this server answers to?"""
    parts = split_host(host_header or "")
    if parts is None:
        return False  # missing (HTTP/1.1 requires it; a browser always sends it) or malformed
    name = _bare(parts[0])
    if name in LOOPBACK_NAMES or name.endswith(".localhost") or name in policy.hosts:
        return True
    address = _address(name)
    return address is not None and (address.is_loopback or policy.any_address)


def same_origin(origin: str, scheme: str, host_header: str) -> bool:
    """Is `origin` the page's own: the scheme, host and port this request was sent to?"""
    parts = split_host(host_header)
    if parts is None:
        return False
    name, port = parts
    own = f"{scheme}://{name}" + (f":{port}" if port is not None else "")
    return normalise_origin(origin) == normalise_origin(own)


def origin_allowed(policy: Policy, origin: str) -> bool:
    """Is `origin` one the user allowed to call this server from its pages?"""
    return normalise_origin(origin) in policy.origins


def normalise_origin(origin: str) -> str:
    """'HTTP://LocalHost:80/' -> 'http://localhost'; "null" stays; junk -> "" (a user or
    password before the host included: 'http://evil.com@127.0.0.1' names no origin)."""
    origin = origin.strip().rstrip("/").lower()
    if origin == "null":
        return origin
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return ""
    if not parts.scheme or not parts.hostname or parts.path or parts.query or parts.fragment \
            or "@" in parts.netloc:
        return ""
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if port is not None and port != DEFAULT_PORTS.get(parts.scheme):
        host += f":{port}"
    return f"{parts.scheme}://{host}"


def referer_origin(referer: str) -> str:
    """The origin of a Referer URL ('http://a.example:8080/page?q' -> 'http://a.example:8080');
    "" when it names none."""
    try:
        parts = urlsplit(referer.strip())
    except ValueError:
        return ""
    if not parts.scheme or not parts.netloc:
        return ""
    return normalise_origin(f"{parts.scheme}://{parts.netloc}")


def bearer_token(authorization: str) -> str | None:
    """The key of an "Authorization: Bearer KEY" header, read as HTTP reads it: the scheme
    in any case, any run of spaces or tabs around the key; None for any other header."""
    parts = authorization.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1]


def split_host(host_header: str) -> tuple[str, int | None] | None:
    """'example.com:80' -> ('example.com', 80); '[::1]:7860' -> ('[::1]', 7860);
    None for anything that is not a name or address with an optional port."""
    match = HOST_HEADER.fullmatch(host_header.strip())
    if match is None:
        return None
    port = match["port"]
    if port is not None and not 0 < int(port) < 2**16:
        return None
    return match["name"], int(port) if port is not None else None


def _bare(name: str) -> str:
    return name.strip().lower().strip("[]").rstrip(".")


def _address(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None

# The longest API reply when a request sets no max_tokens (--max-reply-tokens): it runs to
# the context's end or its own stop otherwise, and one request must not hold the queue for
# a whole long context.
DEFAULT_REPLY_CAP = 4096
