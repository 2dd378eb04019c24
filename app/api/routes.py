"""OpenAI-compatible routes on the page's own FastAPI app: GET /v1/models and
/v1/models/{id}, POST /v1/chat/completions and /v1/completions (whole replies, or
server-sent chunks ending with `data: [DONE]`) and POST /v1/embeddings; any other /v1 path
or method answers OpenAI's error object.

Responses carry Quickdraft's figures in an extra `quickdraft` field (the method a reply used,
tokens per model step) that OpenAI clients ignore; requests choose the acceleration with an
extra `accel` field (default Auto).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.api import bodies
from app.api.completions import EmbeddingRequest, TextRequest, encode_vector, prompt_ids
from app.api.errors import ApiError, OpenAIRoute
from app.api.schema import check_prompt_size, check_reply_length, parse, parse_body, shown
from app.api.worker import Reply, ReplyWorker
from app.host import model_name
from app.reply_core import Ask
from app.security import DEFAULT_REPLY_CAP, bearer_token
from app.service import Service
from engine.config import ChatPrompt, SamplingParams
from engine.decode import grammar as grammars
from engine.decode.chat_template import encode, supports_tools
from engine.decode.loaded import LoadedModel
from engine.errors import QuickdraftError
from engine.model.embed import embed

ROUTES = {"/v1/models": ("GET",), "/v1/chat/completions": ("POST",),
          "/v1/completions": ("POST",), "/v1/embeddings": ("POST",)}


@dataclass(frozen=True)
class ApiOptions:
    """How the API is served."""

    api_key: str | None = None  # required as "Authorization: Bearer KEY" when set
    max_reply_tokens: int = DEFAULT_REPLY_CAP  # a reply's length when a request sets none


def build_router(service: Service, options: ApiOptions) -> tuple[APIRouter, ReplyWorker]:
    """The /v1 routes for `service`, and the worker that runs their replies. Every route
    answers its failures, the ApiErrors it raises included, in OpenAI's shape
    (app/api/errors.py: OpenAIRoute)."""
    worker = ReplyWorker(service)
    router = APIRouter(prefix="/v1", route_class=OpenAIRoute)

    async def admitted(request: Request, parse_body: Callable[[object], object]):
        """A POST past the key check, its body parsed, and the loaded model it names."""
        _authorize(request, options)
        req = parse_body(await _json(request))
        return req, _loaded(service, req.model)

    @router.get("/models")
    async def models(request: Request):
        _authorize(request, options)
        return {"object": "list", "data": [_card(_loaded(service, None))]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        _authorize(request, options)
        return _card(_loaded(service, model_id))

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        req, lm = await admitted(
            request, lambda body: parse(body, SamplingParams().max_new_tokens))
        check_prompt_size(req, lm.context_len)
        ask, prompt_tokens = await _chat_ask(lm, req, options)
        reply = worker.submit(Reply(req, asyncio.get_running_loop(), ask, req.n))
        tools = req.tools is not None and req.tools.choice != "none"
        if req.stream:
            head = _head(lm, "chat.completion.chunk", "chatcmpl")
            return _Stream(reply, bodies.chat_chunks(reply, head, prompt_tokens, tools,
                                                     lm.tokenizer))
        head = _head(lm, "chat.completion", "chatcmpl")
        choices = await _whole(reply, request)
        return JSONResponse(bodies.chat_body(reply, head, choices, prompt_tokens, tools,
                                             lm.tokenizer))

    @router.post("/completions")
    async def completions(request: Request):
        req, lm = await admitted(request, lambda body: parse_body(TextRequest, body))
        params = req.params(req.logprobs)
        check_reply_length(params.max_new_tokens, req.max_tokens_key, lm.context_len)
        ids = prompt_ids(lm.tokenizer, req)
        params = fit_reply(params, req.max_tokens_given, len(ids), lm, options, "prompt")
        ask = Ask(ChatPrompt(), params, req.accel, ids=tuple(ids))
        reply = worker.submit(Reply(req, asyncio.get_running_loop(), ask, req.n))
        if req.stream:
            head = _head(lm, "text_completion", "cmpl")
            return _Stream(reply, bodies.text_chunks(reply, head, len(ids), lm.tokenizer))
        choices = await _whole(reply, request)
        head = _head(lm, "text_completion", "cmpl")
        return JSONResponse(bodies.text_body(reply, head, choices, len(ids), lm.tokenizer))

    @router.post("/embeddings")
    async def embeddings(request: Request):
        req, lm = await admitted(request, lambda body: parse_body(EmbeddingRequest, body))
        return JSONResponse(await asyncio.to_thread(_embeddings, service, lm, req))

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE",
                                               "HEAD", "OPTIONS"], include_in_schema=False)
    async def unknown(path: str, request: Request):
        full = f"/v1/{path}"
        if full in ROUTES:
            raise ApiError(405, f"{request.method} is not allowed on {full}: use "
                           f"{', '.join(ROUTES[full])}", None, "method_not_allowed")
        raise ApiError(404, f"Unknown request URL: {request.method} {full}. This "
                       f"server has {', '.join(sorted(ROUTES))}", None, "unknown_url")

    return router, worker


async def _chat_ask(lm: LoadedModel, req, options: ApiOptions) -> tuple[Ask, int]:
    """The chat request as the worker runs it: the prompt encoded through the model's
    template (with its tools), the grammar checked, the reply's length fitted; and the
    prompt's token count."""
    offered = req.tools.offered if req.tools is not None else ()
    if offered and not supports_tools(lm.tokenizer):
        raise ApiError(400, "this model's chat template has no tool support (it never reads "
                       "`tools`): tool calling needs a model whose template has it, such as "
                       "Qwen2.5 or SmolLM3", "tools", "unsupported_value")
    if req.grammar is not None:
        try:  # llguidance reads the tokenizer once per model (~1 s): off the event loop
            await asyncio.to_thread(grammars.check, lm, req.grammar)
        except QuickdraftError as exc:
            param = "response_format" if req.json_reply else "tool_choice"
            raise ApiError(400, str(exc), param, "invalid_value") from exc
    vocab = int(lm.model.config.vocab_size)
    if any(token >= vocab for token, _bias in req.params.logit_bias):
        raise ApiError(400, f"logit_bias names a token id beyond this model's {vocab:,} "
                       "tokens", "logit_bias", "invalid_value")
    prompt = ChatPrompt(tuple(req.messages), req.system, tuple(offered))
    ids = encode(lm.tokenizer, prompt)
    params = fit_reply(req.params, req.max_tokens_given, len(ids), lm, options, "messages")
    return Ask(prompt, params, req.accel, grammar=req.grammar, ids=tuple(ids)), len(ids)


def fit_reply(params: SamplingParams, given: bool, prompt_tokens: int, lm: LoadedModel,
              options: ApiOptions, param: str) -> SamplingParams:
    """The reply's length: as asked when it fits the context with the prompt (else 400
    context_length_exceeded naming both), or up to the context's end, capped by the
    server's --max-reply-tokens, when none was asked."""
    context = lm.context_len
    room = context - prompt_tokens
    if given and params.max_new_tokens > room or room < 1:
        wanted = params.max_new_tokens if given else 1
        raise ApiError(400, f"This model's maximum context length is {context:,} tokens. "
                       f"However, you requested {prompt_tokens + wanted:,} tokens "
                       f"({prompt_tokens:,} in the {param}, {wanted:,} for the reply). "
                       "Shorten the prompt or ask for a shorter reply.", param,
                       "context_length_exceeded")
    if given:
        return params
    return dataclasses.replace(params, max_new_tokens=min(options.max_reply_tokens, room))


def _embeddings(service: Service, lm: LoadedModel, req) -> dict:
    """The embeddings body (run under the host's lock: one model job at a time)."""
    ids = [list(lm.tokenizer(text)["input_ids"]) for text in req.input]
    for i, row in enumerate(ids):
        if len(row) > lm.context_len:
            raise ApiError(400, f"input[{i}] holds {len(row):,} tokens: more than this "
                           f"model's {lm.context_len:,}-token context", "input",
                           "context_length_exceeded")
    hidden = int(lm.model.config.hidden_size)
    if req.dimensions not in (None, hidden):
        raise ApiError(400, f"dimensions must be {hidden} (this model's size) or left out",
                       "dimensions", "invalid_value")
    with service.host.lock:
        vectors = embed(lm, ids)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.base64)}
            for i, v in enumerate(vectors)]
    tokens = sum(len(row) for row in ids)
    return {"object": "list", "data": data, "model": lm.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _card(lm: LoadedModel) -> dict:
    return {"id": lm.model_id, "object": "model", "created": 0, "owned_by": "quickdraft"}


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


def _loaded(service: Service, model: str | None) -> LoadedModel:
    """The loaded model, which `model` (None: any) must name; 503 while one is loading (the
    page's Models tab swaps it)."""
    loading = service.host.loading
    if loading is not None and loading.running:
        raise ApiError(503, f"a model is loading ({loading.title}): retry in a moment", None,
                       "model_loading", "service_unavailable")
    try:
        lm = service.host.lm
    except QuickdraftError as exc:
        raise ApiError(503, str(exc), None, "no_model", "service_unavailable") from exc
    # a request may name the loaded model by its id, its short name or "default"
    if model is not None and model not in {lm.model_id, model_name(lm), "default"}:
        raise ApiError(404, f"the model {shown(model)} does not exist here: this server has "
                       f"{lm.model_id!r} loaded (GET /v1/models)", "model", "model_not_found")
    return lm


def _head(lm: LoadedModel, kind: str, prefix: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind,
            "created": int(time.time()), "model": lm.model_id,
            "system_fingerprint": f"qd-{lm.fingerprint}"}


async def _whole(reply: Reply, request: Request) -> list[bodies.Choice]:
    """Every choice of a whole reply (its ApiError raised when it failed); a client that
    hangs up cancels it."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, reply))
    try:
        return await bodies.collect(reply)
    finally:
        watcher.cancel()
        reply.cancel.set()  # no-op once done; stops the reply if this handler is cancelled


async def _cancel_on_disconnect(request: Request, reply: Reply) -> None:
    """Wait for the client to hang up (the body is read: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    reply.cancel.set()
