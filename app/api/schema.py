"""OpenAI chat-completion requests in, Quickdraft's own types out; errors in OpenAI's shape.

Parsed by hand rather than by a pydantic model so every refusal is a 400 with OpenAI's
`{"error": {"message", "type", "param", "code"}}` body that its clients know how to show.
Fields this server does not know are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.api.tools import ToolSpec, parse_tools, template_calls, tool_grammar
from app.security import prompt_too_long
from app.settings_rules import text_problem
from engine.config import MAX_TOP_LOGPROBS, ChatMessage, SamplingParams
from engine.decode import grammar as grammars
from engine.decode.grammar import Grammar, GrammarError
from engine.drafters.registry import ACCEL_CHOICES

ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer": the newer "system"
MAX_STOP = 4  # OpenAI accepts up to four stop sequences
MAX_N = 4  # choices one request may ask for (each is a reply of its own, one after another)
DEFAULT_ACCEL = "auto"  # the app's own default: the fastest drafter per step
SEED_RANGE = (-(2**63), 2**64 - 1)  # what the generator's manual_seed accepts
# OpenAI's ranges: (low, high, default)
RANGES = {"temperature": (0.0, 2.0, 1.0), "top_p": (0.0, 1.0, 1.0),
          "presence_penalty": (-2.0, 2.0, 0.0), "frequency_penalty": (-2.0, 2.0, 0.0)}

# OpenAI features the engine does not provide: each answered 400 naming it rather than
# silently ignored (a client asking for them would believe it got them). Each maps to the
# values that mean "not used".
UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
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
    # False: no max_tokens was sent, the reply may run to the context's end (capped by the
    # server's --max-reply-tokens): the route sets the length once the prompt is tokenized
    max_tokens_given: bool = True
    tools: ToolSpec | None = None  # the functions offered, and how the reply may call them
    grammar: Grammar | None = None  # what the reply must match (response_format, tool_choice)
    n: int = 1  # choices asked for
    json_reply: bool = False  # response_format asked for JSON: the reply is parsed as such


def parse(body: object, default_max_tokens: int) -> CompletionRequest:
    """Check a request body; raises ApiError(400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    messages, system = _messages(body.get("messages"))
    _unsupported(body)
    tools = parse_tools(body, bad)
    schema = response_schema(body.get("response_format"))
    grammar = _grammar(tools, schema)
    return CompletionRequest(model, messages, system, sampling_params(body, default_max_tokens),
                             accel_of(body), stream_of(body), include_usage(body),
                             _max_tokens_key(body), max_tokens_given(body), tools, grammar,
                             n_of(body), schema is not None)


def accel_of(body: dict) -> str:
    accel = body.get("accel", DEFAULT_ACCEL)
    if accel not in ACCEL_CHOICES:
        raise bad(f"unknown acceleration {shown(accel)}: choose one of "
                  f"{', '.join(ACCEL_CHOICES)}",
                   "accel")
    return accel


def stream_of(body: dict) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    return stream


def include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    return bool(options.get("include_usage"))


def n_of(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise bad(f"n must be an integer from 1 to {MAX_N}", "n")
    return n


def response_schema(value) -> dict | None:
    """The JSON schema `response_format` asks the reply to match (json_object: any object);
    None for text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema must be a JSON schema object",
                       "response_format")
        return schema
    raise bad("response_format.type must be text, json_object or json_schema",
               "response_format")


def _grammar(tools: ToolSpec | None, schema: dict | None) -> Grammar | None:
    """What the reply must match: the tools' call format where tool_choice demands a call
    (or allows one beside a response format), else the response format's schema."""
    try:
        if tools is not None and (g := tool_grammar(tools, schema)) is not None:
            return g
        return grammars.json_schema(schema, "response_format") if schema is not None else None
    except GrammarError as exc:
        raise bad(str(exc), "response_format") from exc


def _unsupported(body: dict) -> None:
    for key, unused in UNSUPPORTED.items():
        value = body.get(key)
        if not any(type(value) is type(u) and value == u for u in unused):
            raise bad(f"{key} is not supported by this server: leave it out", key)


def check_prompt_size(req: CompletionRequest, context_len: int) -> None:
    """Refuse a prompt or a reply length that cannot fit the model's context, before
    tokenizing the prompt and before a stream opens (its errors would follow a 200)."""
    chars = sum(len(m.content) for m in req.messages) + len(req.system or "")
    if (why := prompt_too_long(chars, context_len)) is not None:
        raise ApiError(400, why, "messages", "context_length_exceeded")
    check_reply_length(req.params.max_new_tokens, req.max_tokens_key, context_len)


def check_reply_length(max_new_tokens: int, key: str, context_len: int) -> None:
    """Refuse a reply length that leaves no room for a prompt."""
    if max_new_tokens >= context_len:  # the prompt needs at least one token
        raise ApiError(400, f"{key} ({shown(max_new_tokens)}) leaves no room for a "
                       f"prompt in this model's {context_len:,}-token context: ask for fewer",
                       key, "context_length_exceeded")


def _messages(value) -> tuple[tuple[ChatMessage, ...], str | None]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list", "messages")
    turns, system = [], []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role {shown(role)} is not one of {', '.join(ROLES)}",
                       f"messages[{i}].role")
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list) or (calls and role != "assistant"):
            raise bad(f"messages[{i}].tool_calls must be a list, in an assistant message",
                       f"messages[{i}].tool_calls")
        content = message.get("content")
        # an assistant turn that only calls tools has no content (OpenAI sends null)
        text = "" if content is None and role == "assistant" else _content(content, i)
        if role in ("system", "developer"):
            system.append(text)
        elif role == "tool":
            turns.append(ChatMessage(role, text,
                                     tool_call_id=_text_field(message, i, "tool_call_id"),
                                     name=_text_field(message, i, "name")))
        else:
            turns.append(ChatMessage(role, text, template_calls(calls, bad, f"messages[{i}]")))
    if not any(t.role == "user" for t in turns) or not (
            turns[-1].content.strip() or turns[-1].role == "tool"):
        raise bad("messages need a user message, and the last one must not be empty", "messages")
    return tuple(turns), "\n\n".join(system) if system else None


def _text_field(message: dict, i: int, key: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise bad(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
    return value


def _content(value, i: int) -> str:
    """A string, or OpenAI's list of content parts (text parts only), that a tokenizer takes
    (a JSON escape such as "\\ud800" reads as a lone surrogate, which none does)."""
    key = f"messages[{i}].content"
    if isinstance(value, list):
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            value = "".join(texts)
    if not isinstance(value, str):
        raise bad(f"{key} must be a string or a list of text parts", key)
    if (why := text_problem(value)) is not None:
        raise bad(f"{key} {why}", key)
    return value


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    key = _max_tokens_key(body)
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not is_int(max_tokens) or max_tokens < 1:
        raise bad(f"{key} must be a positive integer", key)
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise bad("seed must be an integer", "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise bad("seed must be between -2**63 and 2**64 - 1", "seed")
    numbers = {k: _number(body, k) for k in RANGES}
    return SamplingParams(max_new_tokens=max_tokens, stop=_stop(body.get("stop")), seed=seed,
                          logit_bias=logit_bias(body.get("logit_bias")),
                          logprobs=_logprobs(body), **numbers)


def logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} as (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad("logit_bias must map token ids to numbers", "logit_bias")
    out = []
    for token, bias in value.items():
        if not str(token).isdigit() or isinstance(bias, bool) or \
                not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise bad("logit_bias must map token ids (digits) to numbers in [-100, 100]",
                       "logit_bias")
        out.append((int(token), float(bias)))
    return tuple(out)


def _logprobs(body: dict) -> int | None:
    """How many alternatives each token reports: None when logprobs is off."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, True, False):
        raise bad("logprobs must be true or false", "logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}",
                   "top_logprobs")
    if top and not wanted:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"stop takes at most {MAX_STOP} strings", "stop")
    for stop in stops:
        if (why := text_problem(stop)) is not None:  # "\ud800": no reply's text can hold it
            raise bad(f"stop {why}", "stop")
    return tuple(stops)


def _max_tokens_key(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"


def max_tokens_given(body: dict) -> bool:
    return body.get(_max_tokens_key(body)) is not None


def _number(body: dict, key: str) -> float:
    """body[key] as a float within OpenAI's range for it (RANGES; its default when absent).
    Temperature 0 is greedy."""
    low, high, default = RANGES[key]
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"{key} must be a number", key)
    try:
        number = float(value)  # an integer of 400 digits overflows
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):  # Python's JSON reader takes NaN, Infinity and 1e400
        raise bad(f"{key} must be a finite number", key)
    if not low <= number <= high:
        raise bad(f"{key} must be in [{low:g}, {high:g}]", key)
    return number


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value, limit: int = 60) -> str:
    """A client's value as an error message quotes it: its repr, cut to `limit` characters
    (a 100,000-character model name or a 400-digit number is not repeated back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else "invalid_request")
