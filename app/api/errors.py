"""The one error wrapper of the /v1 routes: every route registered on a router made with
`route_class=OpenAIRoute` answers a refusal (ApiError, raised anywhere in the route) in
OpenAI's error shape, a request FastAPI could not read as one line naming its field, and
anything else as a 500 whose one line carries an id logged beside the traceback. No
Python text (exception types, paths, codec messages) reaches a client."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from app.api.schema import ApiError
from app.failures import report

log = logging.getLogger(__name__)


MESSAGE_CHARS = 500  # an error message is one line of at most this many characters


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
                return error_response(_invalid(exc))
            except HTTPException as exc:
                return error_response(ApiError(exc.status_code, _http_message(exc.status_code)))
            except Exception as exc:  # noqa: BLE001 - a client gets one line, the log the rest
                return error_response(internal_error(f"the request {self.path}", exc))

        return guarded


def _invalid(exc: RequestValidationError) -> ApiError:
    """FastAPI's refusal of a request (a typed route's body or query) as one line naming
    the field, without its validator's text."""
    errors = exc.errors()
    where = errors[0].get("loc", ()) if errors else ()
    field = ".".join(str(p) for p in where if p not in ("body", "query", "path", "header"))
    if not field:
        return ApiError(400, "the request is not one this route reads", None, "invalid_request")
    return ApiError(400, f"{field} is missing or has the wrong type", field, "invalid_value")


def _http_message(status: int) -> str:
    return {404: "no such route", 405: "this route does not take that method"}.get(
        status, "the request was refused")
