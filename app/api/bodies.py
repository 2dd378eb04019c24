"""Replies in OpenAI's shapes: whole chat completions and completions, their server-sent
chunks (ending with `data: [DONE]`), tool calls, logprobs and usage. Each reads the
(choice index, ReplyStep) items the worker hands over (app/api/worker.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from app.api.errors import ApiError
from app.api.tools import CallStream, split_calls
from app.api.worker import END, Reply
from app.reply_core import ReplyStep
from engine.errors import QuickdraftError

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
# What a client is told of a failure that is not its mistake: the exception's own text (paths,
# internals) stays in the server's log, where the worker writes it with its traceback.
INTERNAL_ERROR = "the server failed to make this reply: see its log"


@dataclass
class Choice:
    """One choice of a reply, as its steps arrive."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # engine entries, one per token
    last: ReplyStep | None = None

    def add(self, step: ReplyStep) -> None:
        self.token_ids += step.token_ids
        self.logprobs += step.logprobs or []
        self.last = step


def finish_reason(step: ReplyStep) -> str:
    return FINISH.get(step.stats.stop_reason, "stop")


def as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QuickdraftError):
        return ApiError(400, str(exc), None, "generation_refused")
    return ApiError(500, INTERNAL_ERROR, None, "internal_error", "server_error")


async def collect(reply: Reply) -> list[Choice]:
    """Every choice of a whole reply; raises its ApiError when it failed."""
    choices: dict[int, Choice] = {}
    while (item := await reply.events.get()) is not END:
        if isinstance(item, Exception):
            raise as_api_error(item)
        index, step = item
        choices.setdefault(index, Choice(index)).add(step)
    if not choices:  # its client left before its turn: nobody reads this
        raise ApiError(400, "the request was cancelled before it started")
    return [choices[i] for i in sorted(choices)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extension(reply: Reply, step: ReplyStep, token_ids: list[int] | None = None) -> dict:
    """Quickdraft's figures for a finished reply (clients that do not know them ignore them)."""
    stats = step.stats
    out = {"accel": step.method, "tokens_per_step": round(stats.mean_accepted, 3),
           "steps": stats.steps, "tokens_per_s": round(stats.tokens_per_s, 2),
           "stop_reason": stats.stop_reason, "queue_ticket": reply.ticket}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def _token(tokenizer, token_id: int, logprob: float) -> dict:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, ids: list[int], entries: list) -> dict:
    """OpenAI's chat `logprobs` object for tokens `ids` and their engine entries."""
    content = [{**_token(tokenizer, token_id, logprob),
                "top_logprobs": [_token(tokenizer, alt_id, alt_lp) for alt_id, alt_lp in top]}
               for token_id, (logprob, top) in zip(ids, entries, strict=True)]
    return {"content": content, "refusal": None}


def text_logprobs(tokenizer, ids: list[int], entries: list, offset: int) -> dict:
    """The completions endpoint's `logprobs` object (tokens, their logprobs, the top
    alternatives as {token: logprob}, each token's offset in the text)."""
    tokens, offsets = [], []
    for token_id in ids:
        tokens.append(tokenizer.decode([token_id]))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp for lp, _top in entries],
            "top_logprobs": [{tokenizer.decode([t]): v for t, v in top}
                             for _lp, top in entries],
            "text_offset": offsets}


def chat_message(choice: Choice, tools: bool) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a whole chat choice; with `tools`, tool
    calls are read out of its text."""
    text = choice.last.full_text
    if tools:
        content, calls = split_calls(text)
        if calls:
            return ({"role": "assistant", "content": content, "tool_calls": calls},
                    "tool_calls")
    return {"role": "assistant", "content": text}, finish_reason(choice.last)


def chat_body(reply: Reply, head: dict, choices: list[Choice], prompt_tokens: int,
              tools: bool, tokenizer) -> dict:
    out = []
    for c in choices:
        message, finish = chat_message(c, tools)
        logprobs = chat_logprobs(tokenizer, c.token_ids, c.logprobs) \
            if reply.ask.params.logprobs is not None else None
        out.append({"index": c.index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish})
    return _whole_body(reply, head, choices, prompt_tokens, out)


def text_body(reply: Reply, head: dict, choices: list[Choice], prompt_tokens: int,
              tokenizer) -> dict:
    out = []
    for c in choices:
        logprobs = text_logprobs(tokenizer, c.token_ids, c.logprobs, 0) \
            if reply.ask.params.logprobs is not None else None
        out.append({"index": c.index, "text": c.last.full_text, "logprobs": logprobs,
                    "finish_reason": finish_reason(c.last)})
    return _whole_body(reply, head, choices, prompt_tokens, out)


def _whole_body(reply: Reply, head: dict, choices: list[Choice], prompt_tokens: int,
                out: list[dict]) -> dict:
    """A whole reply's body around its choices `out` (made from `choices`)."""
    completion = sum(c.last.stats.tokens for c in choices)
    return {**head, "choices": out, "usage": usage(prompt_tokens, completion),
            "quickdraft": extension(reply, choices[0].last, choices[0].token_ids)}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _chunks(reply: Reply, head: dict, prompt_tokens: int, lines):
    """A reply's server-sent chunks: `lines(index, step)` gives each step's, an error its
    own; then the usage chunk where asked and `[DONE]`. The reply is cancelled when the
    stream ends, a client that hung up included."""
    completion = 0
    try:
        while (item := await reply.events.get()) is not END:
            if isinstance(item, Exception):
                yield sse(as_api_error(item).body())
                continue
            index, step = item
            for line in lines(index, step):
                yield line
            if step.done:
                completion += step.stats.tokens
        if reply.request.include_usage:  # OpenAI's extra last chunk, no choices
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion)})
        yield "data: [DONE]\n\n"
    finally:
        reply.cancel.set()


def chat_chunks(reply: Reply, head: dict, prompt_tokens: int, tools: bool, tokenizer):
    """A chat reply's server-sent chunks: each choice's text as it comes (a tool call's
    markup held back and sent as tool_calls deltas when the choice ends)."""
    streams: dict[int, CallStream] = {}

    def lines(index: int, step: ReplyStep) -> list[str]:
        out = []
        if index not in streams:
            streams[index] = CallStream()
            out.append(_chat_chunk(head, index, {"role": "assistant", "content": ""}))
        text = streams[index].push(step.text) if tools else step.text
        logprobs = chat_logprobs(tokenizer, step.token_ids, step.logprobs) \
            if step.logprobs is not None else None
        if text or logprobs:
            out.append(_chat_chunk(head, index, {"content": text}, logprobs=logprobs))
        if step.done:
            out += _chat_end(reply, head, index, step, streams[index], tools)
        return out

    return _chunks(reply, head, prompt_tokens, lines)


def _chat_end(reply: Reply, head: dict, index: int, step: ReplyStep, stream: CallStream,
              tools: bool) -> list[str]:
    finish = finish_reason(step)
    out = []
    if tools:
        rest, calls = stream.finish()
        if rest and not calls:
            out.append(_chat_chunk(head, index, {"content": rest}))
        elif calls:
            deltas = [{"index": i, **call} for i, call in enumerate(calls)]
            out.append(_chat_chunk(head, index, {"tool_calls": deltas}))
            finish = "tool_calls"
    out.append(_chat_chunk(head, index, {}, finish, quickdraft=extension(reply, step)))
    return out


def _chat_chunk(head: dict, index: int, delta: dict, finish: str | None = None,
                logprobs: dict | None = None, **extra) -> str:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return sse({**head, "choices": [choice], **extra})


def text_chunks(reply: Reply, head: dict, prompt_tokens: int, tokenizer):
    """A completion's server-sent chunks."""
    offsets: dict[int, int] = {}

    def lines(index: int, step: ReplyStep) -> list[str]:
        logprobs = None
        if step.logprobs is not None:
            logprobs = text_logprobs(tokenizer, step.token_ids, step.logprobs,
                                     offsets.get(index, 0))
        offsets[index] = len(step.full_text)
        finish = finish_reason(step) if step.done else None
        if not (step.text or logprobs or finish):
            return []
        choice = {"index": index, "text": step.text, "logprobs": logprobs,
                  "finish_reason": finish}
        extra = {"quickdraft": extension(reply, step)} if step.done else {}
        return [sse({**head, "choices": [choice], **extra})]

    return _chunks(reply, head, prompt_tokens, lines)
