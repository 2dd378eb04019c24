"""OpenAI chat-completion requests in, Quickdraft's own types out; errors in OpenAI's shape.

Parsed by hand rather than by a pydantic model so every refusal is a 400 with OpenAI's
`{"error": {"message", "type", "param", "code"}}` body that its clients know how to show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.security import prompt_too_long
from app.settings_rules import problem, text_problem
from engine.config import ChatMessage, SamplingParams
from engine.drafters.registry import ACCEL_CHOICES

ROLES = ("system", "developer", "user", "assistant")  # "developer": OpenAI's newer "system"
MAX_STOP = 4  # OpenAI accepts up to four stop sequences
DEFAULT_ACCEL = "auto"  # the app's own default: the fastest drafter per step
SEED_RANGE = (-(2**63), 2**64 - 1)  # what the generator's manual_seed accepts

# OpenAI features the engine does not provide: each answered 400 naming it rather than
# silently ignored (a client asking for them would believe it got them). Each maps to the
# values that mean "not used".
UNSUPPORTED = {
    "tools": (None, []), "functions": (None, []), "function_call": (None, "none", "auto"),
    "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "response_format": (None, {"type": "text"}),
}


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


@dataclass(frozen=True)
class CompletionRequest:
    """A validated POST /v1/chat/completions body."""

    model: str | None  # the id asked for (None: whatever is loaded)
    messages: tuple[ChatMessage, ...]  # user/assistant turns, in order
    system: str | None  # system (and developer) messages joined
    params: SamplingParams
    accel: str  # Quickdraft extension: acceleration method (default Auto)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    max_tokens_key: str = "max_tokens"  # the field the reply's length came from (for errors)


def parse(body: object, default_max_tokens: int) -> CompletionRequest:
    """Check a request body; raises ApiError(400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string", "model")
    messages, system = _messages(body.get("messages"))
    if body.get("n") not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    _unsupported(body)
    accel = body.get("accel", DEFAULT_ACCEL)
    if accel not in ACCEL_CHOICES:
        raise _bad(f"unknown acceleration {shown(accel)}: choose one of "
                   f"{', '.join(ACCEL_CHOICES)}",
                   "accel")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return CompletionRequest(model, messages, system, _params(body, default_max_tokens), accel,
                             stream, bool(options.get("include_usage")), _max_tokens_key(body))


def _unsupported(body: dict) -> None:
    for key, unused in UNSUPPORTED.items():
        value = body.get(key)
        if not any(type(value) is type(u) and value == u for u in unused):
            raise _bad(f"{key} is not supported by this server: leave it out", key)


def check_prompt_size(req: CompletionRequest, context_len: int) -> None:
    """Refuse a prompt or a reply length that cannot fit the model's context, before
    tokenizing the prompt and before a stream opens (its errors would follow a 200)."""
    chars = sum(len(m.content) for m in req.messages) + len(req.system or "")
    if (why := prompt_too_long(chars, context_len)) is not None:
        raise ApiError(400, why, "messages", "context_length_exceeded")
    if req.params.max_new_tokens >= context_len:  # the prompt needs at least one token
        key = req.max_tokens_key
        raise ApiError(400, f"{key} ({shown(req.params.max_new_tokens)}) leaves no room for a "
                       f"prompt in this model's {context_len:,}-token context: ask for fewer",
                       key, "context_length_exceeded")


def _messages(value) -> tuple[tuple[ChatMessage, ...], str | None]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list", "messages")
    turns, system = [], []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role {shown(role)} is not one of {', '.join(ROLES)}",
                       f"messages[{i}].role")
        text = _content(message.get("content"), i)
        if role in ("system", "developer"):
            system.append(text)
        else:
            turns.append(ChatMessage(role, text))
    if not any(t.role == "user" for t in turns) or not turns[-1].content.strip():
        raise _bad("messages need a user message, and the last one must not be empty", "messages")
    return tuple(turns), "\n\n".join(system) if system else None


def _content(value, i: int) -> str:
    """A string, or OpenAI's list of content parts (text parts only), that a tokenizer takes
    (a JSON escape such as "\\ud800" reads as a lone surrogate, which none does)."""
    key = f"messages[{i}].content"
    if isinstance(value, list):
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            value = "".join(texts)
    if not isinstance(value, str):
        raise _bad(f"{key} must be a string or a list of text parts", key)
    if (why := text_problem(value)) is not None:
        raise _bad(f"{key} {why}", key)
    return value


def _params(body: dict, default_max_tokens: int) -> SamplingParams:
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    key = _max_tokens_key(body)
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise _bad(f"{key} must be a positive integer", key)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("seed must be an integer", "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise _bad("seed must be between -2**63 and 2**64 - 1", "seed")
    return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens,
                          stop=_stop(body.get("stop")), seed=seed)


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise _bad(f"stop takes at most {MAX_STOP} strings", "stop")
    for stop in stops:
        if (why := text_problem(stop)) is not None:  # "\ud800": no reply's text can hold it
            raise _bad(f"stop {why}", "stop")
    return tuple(stops)


def _max_tokens_key(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"


def _number(body: dict, key: str) -> float:
    """body[key] as a float (1.0, OpenAI's default, when absent), within the range the page
    allows: the sampler divides by the temperature, and below 0.01 (or a top_p below 0.01)
    the probabilities overflow to inf/nan (app/settings_rules.py)."""
    value = body.get(key)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{key} must be a number", key)
    try:
        number = float(value)  # an integer of 400 digits overflows
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):  # Python's JSON reader takes NaN, Infinity and 1e400
        raise _bad(f"{key} must be a finite number", key)
    if (why := problem(key, number)) is not None:
        raise _bad(f"{key} {why}", key)
    return number


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value, limit: int = 60) -> str:
    """A client's value as an error message quotes it: its repr, cut to `limit` characters
    (a 100,000-character model name or a 400-digit number is not repeated back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else "invalid_request")
