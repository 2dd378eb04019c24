"""Tool calling: OpenAI's `tools` / `tool_choice` in, the model's own tool-call markup out.

Tools reach the model through its chat template (`apply_chat_template(tools=...)`), so a
model whose template has no tools is refused. Replies are read in the markup those
templates teach (Hermes / Qwen2.5 / SmolLM3): `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`, one block per call. `tool_choice: required` or a named function
constrains the reply to such blocks with a grammar (engine/decode/grammar.py), whose arguments
follow the function's parameter schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from engine.decode.grammar import JSON_OPTIONS, Grammar, lark

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolSpec:
    """The request's tools and how the reply may use them."""

    tools: tuple[dict, ...]  # {"type": "function", "function": {...}} each, as sent
    choice: str  # "none" | "auto" | "required" | "function" (one named function)
    name: str | None = None  # choice "function": the function it must call
    parallel: bool = True  # several calls in one reply

    @property
    def offered(self) -> tuple[dict, ...]:
        """The tools the template shows the model (none when it may not call any)."""
        return () if self.choice == "none" else self.tools


def call_schema(tool: dict) -> dict:
    """The JSON schema of one call block's object: the function's name and arguments."""
    function = tool["function"]
    params = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(spec: ToolSpec, alternative: dict | None = None) -> Grammar | None:
    """The grammar of a reply that calls tools as `spec` demands: None when the reply may
    be anything (`auto` without a response format, `none`). `alternative`: a JSON schema the
    reply may match instead of calling (a response format alongside `auto`)."""
    if spec.choice == "none" or (spec.choice == "auto" and alternative is None):
        return None
    tools = [t for t in spec.tools if spec.choice != "function" or
             t["function"]["name"] == spec.name]
    schema = {"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 \
        else call_schema(tools[0])
    schema["x-guidance"] = JSON_OPTIONS  # read at a schema's root only
    block = f'"{OPEN}\\n" %json{json.dumps(schema)} "\\n{CLOSE}"'
    calls = 'block ("\\n" block)*' if spec.parallel and spec.choice != "function" else "block"
    if spec.choice == "auto":
        answer = {**alternative, "x-guidance": JSON_OPTIONS}
        start = f"start: calls | %json{json.dumps(answer)}\ncalls: {calls}"
    else:
        start = f"start: {calls}"
    label = f"the tool {spec.name!r}" if spec.name else "the tools' call format"
    return lark(f"{start}\nblock: {block}\n", label)


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """A reply's text and its tool calls in OpenAI's shape. Blocks that do not hold a call
    ({"name": str, "arguments": object}) stay in the text, as the model wrote them."""
    calls, content, rest = [], [], text
    while (start := rest.find(OPEN)) >= 0:
        end = rest.find(CLOSE, start)
        if end < 0:
            break
        call = _call(rest[start + len(OPEN):end])
        if call is None:
            content.append(rest[:end + len(CLOSE)])
        else:
            content.append(rest[:start])
            calls.append(call)
        rest = rest[end + len(CLOSE):]
    content.append(rest)
    joined = "".join(content).strip() if calls else "".join(content)
    return (joined or None) if calls else joined, calls


def _call(inner: str) -> dict | None:
    try:
        call = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments)}}


class CallStream:
    """Streams a reply's text as content until a tool call may begin; what follows is
    held and read as calls when the reply ends (`finish`)."""

    def __init__(self) -> None:
        self.held = ""  # text not yet streamed: a call, or what may begin one

    def push(self, text: str) -> str:
        """The content that can be streamed now, of `text` added to the reply."""
        self.held += text
        start = self.held.find(OPEN)
        if start < 0:  # keep a tail that could be the start of OPEN
            start = len(self.held) - next(
                (k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                 if OPEN.startswith(self.held[-k:])), 0)
        out, self.held = self.held[:start], self.held[start:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(the content still held, the calls) once the reply ended."""
        text, calls = split_calls(self.held)
        return text or "", calls


def template_calls(calls) -> tuple[dict, ...]:
    """An assistant turn's OpenAI tool_calls (the request's checked ToolCall models) as
    chat templates read them: arguments as objects where they parse."""
    out = []
    for call in calls:
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                pass
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return tuple(out)
