"""What people are told of a failure that is not their mistake: one line with an id, while
the traceback goes to the log under the same id. Python's own text (exception types, paths,
internals) never reaches the page, the API or a job's status; the id finds it in the log.
The page's events (app/ui/guarded.py), the API's routes (app/api/errors.py), the API's
worker and background jobs all report through here."""

from __future__ import annotations

import logging
import secrets


def report(log: logging.Logger, what: str, exc: BaseException) -> str:
    """Log `exc` with its traceback under a new id; the line for people, naming `what`
    failed (e.g. "the reply") and the id."""
    incident = secrets.token_hex(4)
    log.error("%s failed (error %s)", what, incident, exc_info=exc)
    return f"{what[:1].upper()}{what[1:]} failed unexpectedly (error {incident}): the app's " \
           "log has the details."
