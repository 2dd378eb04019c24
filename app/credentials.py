"""Secrets for the login and the API key from somewhere other than the command line: a flag's
value is visible to every user of the machine in the process list, a file's or an
environment variable's is not."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from engine.errors import QuickdraftError

API_KEY_ENV = "QUICKDRAFT_API_KEY"  # the /v1 key, like --api-key
AUTH_ENV = "QUICKDRAFT_AUTH"  # USER:PASSWORD, like --auth


def secret(flag: str, value: str | None, file: str | None, env_name: str,
           environ: Mapping[str, str]) -> str | None:
    """The secret from `--flag`, else `--flag-file`, else the environment; None if none."""
    if value is not None and file is not None:
        raise QuickdraftError(f"give --{flag} or --{flag}-file, not both")
    if value is not None:
        return value
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise QuickdraftError(f"cannot read --{flag}-file {file}: {exc}") from exc
        if not text:
            raise QuickdraftError(f"--{flag}-file {file} is empty")
        return text
    return environ.get(env_name) or None
