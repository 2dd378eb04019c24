"""OpenAI's error object, and the one error wrapper of the /v1 routes.

Every route registered on a router made with `route_class=OpenAIRoute` answers a refusal
(ApiError, raised anywhere in the route) in OpenAI's error shape, a request its models could
not read (pydantic's validation errors, `refusal`) as one line naming its field, and anything
else as a 500 whose one line carries an id logged beside the traceback. No Python text
(exception types, paths, codec messages, a validator's words) reaches a client."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from app.failures import report

log = logging.getLogger(__name__)


MESSAGE_CHARS = 500  # an error message is one line of at most this many characters
# What an HTTPException of FastAPI's own (a route or method it does not serve) is told.
HTTP_MESSAGES = {404: "no such route", 405: "this route does not take that method"}


class ApiError(Exception):
    """A refusal with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else "invalid_request")


# A validation error's type as a client reads it; a type not listed is "is not valid".
WORDS = {"missing": "is required", "string_type": "must be a string",
         "int_type": "must be an integer", "int_from_float": "must be an integer",
         "float_type": "must be a number", "finite_number": "must be a finite number",
         "bool_type": "must be true or false", "list_type": "must be a list",
         "dict_type": "must be an object", "model_type": "must be an object",
         "greater_than_equal": "must be at least {ge}", "too_short": "must not be empty",
         "too_long": "takes at most {max_length}", "literal_error": "must be one of {expected}"}


def refusal(errors: list[dict]) -> ApiError:
    """The first of pydantic's (or FastAPI's) validation errors as OpenAI's 400: the param
    is the field's path (`messages[0].content`), the message our words for the error's type,
    or a check's own (ValueError) message."""
    error = errors[0] if errors else {"loc": (), "type": ""}
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]
                    if p not in ("body", "query", "path", "header")).lstrip(".") or None
    ctx = error.get("ctx") or {}
    if isinstance(ctx.get("error"), ValueError):
        words = str(ctx["error"])
    else:
        words = WORDS.get(error["type"], "is not valid").format(**ctx)
    return bad(f"{param or 'the request'} {words}", param)


def error_response(exc: ApiError) -> JSONResponse:
    """OpenAI's `{"error": {"message", "type", "param", "code"}}` with the status; the
    message one line, at most MESSAGE_CHARS long, whatever a route put in it."""
    body = exc.body()
    line = " ".join(str(body["error"]["message"]).split())
    body["error"]["message"] = line if len(line) <= MESSAGE_CHARS else \
        line[:MESSAGE_CHARS - 1] + "…"
    return JSONResponse(body, status_code=exc.status)


def internal_error(what: str, exc: BaseException) -> ApiError:
    """A 500 for a failure that is not the client's: one line with an id (app.failures)."""
    return ApiError(500, report(log, what, exc), None, "internal_error", "server_error")


class OpenAIRoute(APIRoute):
    """A route whose every failure is answered in OpenAI's error shape (see the module)."""

    def get_route_handler(self) -> Callable[[Request], object]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                return error_response(exc)
            except RequestValidationError as exc:
                return error_response(refusal(exc.errors()))
            except HTTPException as exc:
                return error_response(ApiError(exc.status_code, HTTP_MESSAGES.get(
                    exc.status_code, "the request was refused")))
            except Exception as exc:  # noqa: BLE001 - a client gets one line, the log the rest
                return error_response(internal_error(f"the request {self.path}", exc))

        return guarded
