"""OpenAI's request bodies as pydantic models; errors in OpenAI's shape.

Every refusal is a 400 with OpenAI's `{"error": {"message", "type", "param", "code"}}` body
that its clients know how to show: `refusal` turns a model's validation errors into one, its
param the field's path as OpenAI writes it (`messages[0].role`), its message our own words
(never the validator's). Fields this server does not know are ignored, as OpenAI-compatible
servers do; types are strict (`true` is not a number, `1.5` not an integer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from app.api.errors import ApiError, bad, refusal
from app.api.tools import ToolSpec, template_calls, tool_grammar
from app.security import prompt_too_long
from app.settings_rules import text_problem
from engine.config import MAX_TOP_LOGPROBS, ChatMessage, SamplingParams
from engine.decode import grammar as grammars
from engine.decode.grammar import Grammar, GrammarError
from engine.drafters.registry import ACCEL_CHOICES

MAX_STOP = 4  # OpenAI accepts up to four stop sequences
MAX_N = 4  # choices one request may ask for (each is a reply of its own, one after another)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what the generator's manual_seed accepts


def valid_text(value: str) -> str:
    if (why := text_problem(value)) is not None:  # "\ud800": no tokenizer or file takes it
        raise ValueError(why)
    return value


def within(low: float, high: float):
    """A check that a number lies in OpenAI's range for it."""
    def check(value):
        if not low <= value <= high:
            raise ValueError(f"must be in [{low:g}, {high:g}]" if isinstance(value, float)
                             else f"must be an integer from {low} to {high}")
        return value
    return AfterValidator(check)


Text = Annotated[str, AfterValidator(valid_text)]
Finite = Annotated[float, Field(allow_inf_nan=False)]  # Python's JSON reader takes NaN
Positive = Annotated[int, Field(ge=1)]


def _stops(value: Any) -> tuple[str, ...]:
    stops = () if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise ValueError(f"takes at most {MAX_STOP} strings")
    return tuple(valid_text(s) for s in stops)


def _bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} as (id, bias) pairs. Checked whole here, so
    no refusal names a client's key as a field (and NaN fails the range check)."""
    pairs = {} if value is None else value
    if not isinstance(pairs, dict) or not all(
            re.fullmatch(r"[0-9]{1,18}", t) and type(b) in (int, float) and -100 <= b <= 100
            for t, b in pairs.items()):
        raise ValueError("must map token ids (digits) to numbers in [-100, 100]")
    return tuple((int(t), float(b)) for t, b in pairs.items())


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    # OpenAI features the engine does not provide: each answered 400 naming it rather than
    # silently ignored (a client asking for them would believe it got them). Each maps to
    # the values that mean "not used".
    unsupported: ClassVar[dict[str, tuple]] = {}


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The fields every generating request shares."""

    model: str | None = None  # the id asked for (None: whatever is loaded)
    temperature: Annotated[Finite, within(0.0, 2.0)] = 1.0  # 0 is greedy
    top_p: Annotated[Finite, within(0.0, 1.0)] = 1.0
    presence_penalty: Annotated[Finite, within(-2.0, 2.0)] = 0.0
    frequency_penalty: Annotated[Finite, within(-2.0, 2.0)] = 0.0
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None  # the newer name of max_tokens
    seed: Annotated[int, within(*SEED_RANGE)] | None = None
    stop: Annotated[Any, AfterValidator(_stops)] = ()
    logit_bias: Annotated[Any, AfterValidator(_bias)] = ()
    n: Annotated[int, within(1, MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    accel: Literal[ACCEL_CHOICES] = "auto"  # Quickdraft's own: the acceleration method

    @property
    def include_usage(self) -> bool:
        """stream_options.include_usage: a last chunk with the usage."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def max_tokens_key(self) -> str:
        """The field the reply's length came from (for errors)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None \
            else "max_tokens"

    @property
    def max_tokens_given(self) -> bool:
        """False: the reply may run to the context's end (capped by the server's
        --max-reply-tokens): the route sets the length once the prompt is tokenized."""
        return getattr(self, self.max_tokens_key) is not None

    def params(self, logprobs: int | None,
               default_max_tokens: int = SamplingParams.max_new_tokens) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=getattr(self, self.max_tokens_key) or default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, stop=self.stop, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, logprobs=logprobs)


ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer": the newer "system"


def _content(value: Any) -> str | None:
    """A string, or OpenAI's list of content parts (text parts only); None for none (an
    assistant turn that only calls tools: OpenAI sends null)."""
    if isinstance(value, list):
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            value = "".join(texts)
    if value is not None and not isinstance(value, str):
        raise ValueError("must be a string or a list of text parts")
    return value if value is None else valid_text(value)


class CallFunction(Strict):
    name: str
    arguments: Any = "{}"  # a JSON text, as OpenAI sends it (an object is taken too)


class ToolCall(Strict):
    id: str | None = None
    function: CallFunction


class Message(Strict):
    role: Literal[ROLES]
    content: Annotated[Any, AfterValidator(_content)] = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: Text | None = None  # a tool turn: the call it answers
    name: Text | None = None


class AsSent(Strict):
    """A part the chat template is handed as the client sent it, unknown fields included."""

    model_config = ConfigDict(extra="allow")


class Function(AsSent):
    name: Annotated[str, Field(min_length=1)]
    parameters: dict | None = None  # a JSON schema of its arguments


class Tool(AsSent):
    type: Literal["function"] = "function"
    function: Function


class ChatBody(Sampling):
    """POST /v1/chat/completions."""

    unsupported: ClassVar[dict[str, tuple]] = {
        "functions": (None, []), "function_call": (None, "none", "auto"),
        "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,)}

    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, within(0, MAX_TOP_LOGPROBS)] | None = None
    response_format: Any = None  # read by `response_schema`
    tools: list[Tool] | None = None
    tool_choice: Any = None  # read by `_tool_spec`
    parallel_tool_calls: bool = True


def parse_body(model: type[Strict], body: object) -> Strict:
    """`body` as `model`; raises ApiError(400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise refusal(exc.errors()) from None
    for key, unused in model.unsupported.items():
        value = body.get(key)
        if not any(type(value) is type(u) and value == u for u in unused):
            raise bad(f"{key} is not supported by this server: leave it out", key)
    return request


@dataclass(frozen=True)
class CompletionRequest:
    """A validated POST /v1/chat/completions body, as the route and the worker use it."""

    model: str | None  # the id asked for (None: whatever is loaded)
    messages: tuple[ChatMessage, ...]  # user/assistant/tool turns, in order
    system: str | None  # system (and developer) messages joined
    params: SamplingParams
    accel: str
    stream: bool
    include_usage: bool
    max_tokens_key: str  # the field the reply's length came from (for errors)
    max_tokens_given: bool  # False: up to the context's end (Sampling.max_tokens_given)
    tools: ToolSpec | None  # the functions offered, and how the reply may call them
    grammar: Grammar | None  # what the reply must match (response_format, tool_choice)
    n: int  # choices asked for
    json_reply: bool  # response_format asked for JSON: the reply is parsed as such


def parse(body: object, default_max_tokens: int) -> CompletionRequest:
    """Check a chat request's body; raises ApiError(400) naming the offending parameter."""
    req = parse_body(ChatBody, body)
    messages, system = _turns(req.messages)
    if req.top_logprobs and not req.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tools = _tool_spec(req)
    schema = response_schema(req.response_format)
    return CompletionRequest(req.model, messages, system,
                             req.params(logprobs, default_max_tokens), req.accel, req.stream,
                             req.include_usage, req.max_tokens_key, req.max_tokens_given,
                             tools, _grammar(tools, schema), req.n, schema is not None)


def _turns(messages: list[Message]) -> tuple[tuple[ChatMessage, ...], str | None]:
    """The conversation's turns, and its system (and developer) messages joined."""
    turns, system = [], []
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise bad(f"messages[{i}].tool_calls belong in an assistant message",
                      f"messages[{i}].tool_calls")
        if m.content is None and m.role != "assistant":
            raise bad(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages[{i}].content")
        text = m.content or ""
        if m.role in ("system", "developer"):
            system.append(text)
        elif m.role == "tool":
            turns.append(ChatMessage(m.role, text, tool_call_id=m.tool_call_id, name=m.name))
        else:
            turns.append(ChatMessage(m.role, text, template_calls(m.tool_calls or ())))
    if not any(t.role == "user" for t in turns) or not (
            turns[-1].content.strip() or turns[-1].role == "tool"):
        raise bad("messages need a user message, and the last one must not be empty", "messages")
    return tuple(turns), "\n\n".join(system) if system else None


TOOL_CHOICES = ("none", "auto", "required")


def _tool_spec(req: ChatBody) -> ToolSpec | None:
    """The request's tools and how the reply may call them; None when it has none."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    tools = tuple(t.model_dump(exclude_unset=True) for t in req.tools)  # as sent
    if choice is None or choice in TOOL_CHOICES:
        return ToolSpec(tools, choice or "auto", None, req.parallel_tool_calls)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in [t.function.name for t in req.tools]:
        raise bad(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                  f"{{'type': 'function', 'function': {{'name': one of the tools}}}}",
                  "tool_choice")
    return ToolSpec(tools, "function", name, req.parallel_tool_calls)


def response_schema(value: Any) -> dict | None:
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


def check_reply_length(max_new_tokens: int, key: str, context_len: int) -> None:
    """Refuse a reply length that leaves no room for a prompt."""
    if max_new_tokens >= context_len:  # the prompt needs at least one token
        raise ApiError(400, f"{key} ({shown(max_new_tokens)}) leaves no room for a "
                       f"prompt in this model's {context_len:,}-token context: ask for fewer",
                       key, "context_length_exceeded")


def check_prompt_size(req: CompletionRequest, context_len: int) -> None:
    """Refuse a prompt or a reply length that cannot fit the model's context, before
    tokenizing the prompt and before a stream opens (its errors would follow a 200)."""
    chars = sum(len(m.content) for m in req.messages) + len(req.system or "")
    if (why := prompt_too_long(chars, context_len)) is not None:
        raise ApiError(400, why, "messages", "context_length_exceeded")
    check_reply_length(req.params.max_new_tokens, req.max_tokens_key, context_len)


def shown(value, limit: int = 60) -> str:
    """A client's value as an error message quotes it: its repr, cut to `limit` characters
    (a 100,000-character model name or a 400-digit number is not repeated back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
