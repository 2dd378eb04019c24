"""OpenAI-compatible routes on the page's own FastAPI app: GET /v1/models and
POST /v1/chat/completions (whole replies, or server-sent chunks ending with `data: [DONE]`).

Responses carry Quickdraft's figures in an extra `quickdraft` field (the method a reply used,
tokens per model step) that OpenAI clients ignore; requests choose the acceleration with an
extra `accel` field (default Auto).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.api.errors import OpenAIRoute, error_response
from app.api.schema import ApiError, check_prompt_size, parse, shown
from app.api.worker import END, Reply, ReplyWorker
from app.host import model_name
from app.reply_core import ReplyStep
from app.security import bearer_token
from app.service import Service
from engine.config import SamplingParams
from engine.errors import QuickdraftError
from engine.loading import LoadedModel

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


@dataclass(frozen=True)
class ApiOptions:
    """How the API is served."""

    api_key: str | None = None  # required as "Authorization: Bearer KEY" when set


def build_router(service: Service, options: ApiOptions) -> tuple[APIRouter, ReplyWorker]:
    """The /v1 routes for `service`, and the worker that runs their replies. Every route
    answers its failures in OpenAI's shape (app/api/errors.py: OpenAIRoute)."""
    worker = ReplyWorker(service)
    router = APIRouter(prefix="/v1", route_class=OpenAIRoute)

    @router.get("/models")
    async def models(request: Request):
        try:
            _authorize(request, options)
            lm = _ready(service)
        except ApiError as exc:
            return _error(exc)
        card = {"id": lm.model_id, "object": "model", "created": 0, "owned_by": "quickdraft"}
        return {"object": "list", "data": [card]}

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        try:
            _authorize(request, options)
            body = await _json(request)
            req = parse(body, SamplingParams().max_new_tokens)
            lm = _ready(service)
            _check_model(req.model, lm)
            check_prompt_size(req, lm.context_len)
        except ApiError as exc:
            return _error(exc)
        reply = worker.submit(Reply(req, asyncio.get_running_loop()))
        head = _head(lm, "chat.completion.chunk" if req.stream else "chat.completion")
        if req.stream:
            return _Stream(reply, _sse(reply, head))
        return await _whole(reply, head, request)

    return router, worker


class _Stream(StreamingResponse):
    """Server-sent events that cancel their reply however the response ends, even when the
    client leaves before the first chunk (the chunk generator then never starts)."""

    def __init__(self, reply: Reply, chunks):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.reply = reply

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.reply.cancel.set()


def _authorize(request: Request, options: ApiOptions) -> None:
    if options.api_key is None:
        return
    token = bearer_token(request.headers.get("authorization", ""))  # as the guard reads it
    if token is None or not hmac.compare_digest(token.encode(), options.api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' with "
                       "the key given to --api-key", None, "invalid_api_key")


async def _json(request: Request) -> object:
    """The body's JSON; a 400 naming where it stops being JSON (never the parser's own
    words: a codec's message, or Python's limit on an integer's digits)."""
    try:
        return json.loads((await request.body()).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not UTF-8 text (byte {exc.start})", None,
                       "invalid_json") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc.msg} at line {exc.lineno}, "
                       f"column {exc.colno})", None, "invalid_json") from exc
    except ValueError as exc:  # a number too long to read
        raise ApiError(400, "the body's JSON holds a number out of range", None,
                       "invalid_json") from exc
    except RecursionError as exc:
        raise ApiError(400, "the body's JSON is nested too deeply", None, "invalid_json") from exc


def _ready(service: Service) -> LoadedModel:
    """The loaded model; 503 while one is loading (the page's Models tab swaps it)."""
    loading = service.host.loading
    if loading is not None and loading.running:
        raise ApiError(503, f"a model is loading ({loading.title}): retry in a moment", None,
                       "model_loading", "service_unavailable")
    try:
        return service.host.lm
    except QuickdraftError as exc:
        raise ApiError(503, str(exc), None, "no_model", "service_unavailable") from exc


def model_ids(lm: LoadedModel) -> set[str]:
    """Names a request may use for the loaded model: its id, its short name, "default"."""
    return {lm.model_id, model_name(lm), "default"}


def _check_model(model: str | None, lm: LoadedModel) -> None:
    if model is not None and model not in model_ids(lm):
        raise ApiError(404, f"the model {shown(model)} does not exist here: this server has "
                       f"{lm.model_id!r} loaded (GET /v1/models)", "model", "model_not_found")


def _head(lm: LoadedModel, kind: str) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": kind,
            "created": int(time.time()), "model": lm.model_id,
            "system_fingerprint": f"qd-{lm.fingerprint}"}


def _error(exc: ApiError) -> JSONResponse:
    return error_response(exc)


def _extension(reply: Reply, step: ReplyStep, token_ids: list[int] | None = None) -> dict:
    """Quickdraft's figures for a finished reply (clients that do not know them ignore them)."""
    stats = step.stats
    out = {"accel": step.method, "tokens_per_step": round(stats.mean_accepted, 3),
           "steps": stats.steps, "tokens_per_s": round(stats.tokens_per_s, 2),
           "stop_reason": stats.stop_reason, "queue_ticket": reply.ticket}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.tokens,
            "total_tokens": stats.prompt_tokens + stats.tokens}


async def _whole(reply: Reply, head: dict, request: Request) -> JSONResponse:
    """Wait for the whole reply; a client that hangs up cancels it."""
    ids: list[int] = []
    last = None
    watcher = asyncio.create_task(_cancel_on_disconnect(request, reply))
    try:
        while (item := await reply.events.get()) is not END:
            if isinstance(item, Exception):
                return _error(_as_api_error(item))
            last = item
            ids.extend(item.token_ids)
    finally:
        watcher.cancel()
        reply.cancel.set()  # no-op once done; stops the reply if this handler is cancelled
    if last is None:  # its client left before its turn: nobody reads this
        return _error(ApiError(400, "the request was cancelled before it started"))
    message = {"role": "assistant", "content": last.full_text}
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": FINISH.get(last.stats.stop_reason, "stop")}
    return JSONResponse({**head, "choices": [choice], "usage": _usage(last.stats),
                         "quickdraft": _extension(reply, last, ids)})


async def _cancel_on_disconnect(request: Request, reply: Reply) -> None:
    """Wait for the client to hang up (the body is read: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    reply.cancel.set()


async def _sse(reply: Reply, head: dict):
    """Server-sent chunks. A client that disconnects cancels this generator (Starlette
    watches the connection): `finally` sets the reply's cancel flag, the decode loop ends at
    its next step and the queue moves on."""
    try:
        yield _chunk(head, {"role": "assistant", "content": ""})
        while (item := await reply.events.get()) is not END:
            if isinstance(item, Exception):
                yield f"data: {json.dumps(_as_api_error(item).body())}\n\n"
                continue
            if item.text:
                yield _chunk(head, {"content": item.text})
            if item.done:
                finish = FINISH.get(item.stats.stop_reason, "stop")
                yield _chunk(head, {}, finish, quickdraft=_extension(reply, item))
                if reply.request.include_usage:  # OpenAI's extra last chunk, no choices
                    usage = {**head, "choices": [], "usage": _usage(item.stats)}
                    yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        reply.cancel.set()


def _chunk(head: dict, delta: dict, finish: str | None = None, **extra) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return f"data: {json.dumps({**head, 'choices': [choice], **extra})}\n\n"


def _as_api_error(exc: Exception) -> ApiError:
    """What the worker handed over instead of a step: a refusal, or (already logged with its
    id) a failure of the server's."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QuickdraftError):
        return ApiError(400, str(exc), None, "generation_refused")
    return ApiError(500, "the reply failed unexpectedly", None, "internal_error", "server_error")

