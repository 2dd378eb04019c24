"""One conversation as the page shows it and the model continues it, checked as it is read
from its file; which of its replies a model may learn from; and its side-list title."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field

from app.settings_rules import CONVERSATION_ID

TITLE_CHARS = 48  # a new conversation is titled after its first prompt, cut to this length


@dataclass
class Conversation:
    """One chat: what the side list shows and what the model is asked to continue."""

    id: str  # file name stem (hex)
    title: str  # side-list label: the first prompt, until the user renames it
    created: float  # unix time
    updated: float  # unix time of the last change; the list shows the newest first
    system: str = ""  # system prompt of this chat ("" = the model's own default)
    # {"role": "user" | "assistant", "content": str}; replies also keep "stats" (the
    # engine's stats JSON), "accel" (the method that produced them), "model" (the
    # fingerprint of the model that wrote them) and "acceptance" (the rule drafts met)
    messages: list[dict] = field(default_factory=list)

    def turns(self) -> list[dict]:
        """The messages as plain {"role", "content"} dicts (chat template, Chatbot)."""
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def model_turns(self, fingerprint: str) -> list[dict]:
        """The conversation as {"role", "content"} messages (the system prompt first) up to
        its last reply that model `fingerprint` wrote itself, for training its accelerator;
        [] when it has none. It stops before the first reply that is not such a reply:
        what follows was conditioned on it."""
        turns = [{"role": "system", "content": self.system}] if self.system else []
        kept = []
        for m in self.messages:
            if m["role"] == "assistant" and not own_reply(m, fingerprint):
                break
            turns.append({"role": m["role"], "content": m["content"]})
            if m["role"] == "assistant":
                kept = list(turns)
        return kept

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        if self.system:
            lines += [f"*System:* {self.system}", ""]
        for m in self.messages:
            who = "**You**" if m["role"] == "user" else "**Assistant**"
            lines += [who, "", str(m["content"]), ""]
        return "\n".join(lines)

    @classmethod
    def from_json(cls, data, conv_id: str) -> Conversation:
        """A conversation from its file's JSON (`conv_id`: the file's name, which wins over the
        id inside); ValueError saying what is wrong with a file of another shape."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, found {type(data).__name__}")
        if not CONVERSATION_ID.fullmatch(conv_id):
            raise ValueError(f"not a conversation id: {conv_id!r}")
        for key, kind in (("title", str), ("system", str), ("messages", list)):
            if key in data and not isinstance(data[key], kind):
                raise ValueError(f"{key} must be a {kind.__name__}")
        for key in ("created", "updated"):
            if not _is_time(data.get(key)):
                raise ValueError(f"{key} must be a time in seconds")
        messages = [_message(m, i) for i, m in enumerate(data.get("messages", []))]
        return cls(conv_id, data.get("title", "Untitled"), float(data["created"]),
                   float(data["updated"]), data.get("system", ""), messages)


def _is_time(value) -> bool:
    return _is_number(value) and math.isfinite(value)


def _message(m, i: int) -> dict:
    """A stored message checked: a user or assistant turn; content that is not text (a
    hand-edited file) is kept as its JSON text rather than hiding the conversation. What
    the page reads beside the text (the method, the model, the figures) must have its type,
    or the file is refused: a list where a name belongs failed every page load."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise ValueError(f"messages[{i}] must be an object with role user or assistant")
    for key in ("accel", "model", "acceptance"):
        if key in m and not isinstance(m[key], str):
            raise ValueError(f"messages[{i}].{key} must be text")
    if "stats" in m:
        _check_stats(m["stats"], f"messages[{i}].stats")
    content = m.get("content")
    if not isinstance(content, str):
        content = "" if content is None else json.dumps(content)
    return {**m, "content": content}


# The figures of a stored reply the page reads (engine.decode.stats.GenerationStats.to_json), by
# type; keys it does not know (a newer version's) are left alone.
NUMBERS = ("tokens", "steps", "tokens_per_s", "ttft_s", "mean_accepted", "prompt_tokens",
           "prompt_dropped", "elapsed_s", "datastore_drafted", "datastore_accepted",
           "drafting_steps")
TEXTS = ("stop_reason", "step")
NUMBER_LISTS = ("accepted_histogram", "ctar")
COUNTS = ("step_kinds", "kind_accepted")  # {kind: number}


def _check_stats(stats, where: str) -> None:
    if not isinstance(stats, dict):
        raise ValueError(f"{where} must be an object")
    for key, value in stats.items():
        ok = (_is_number(value) if key in NUMBERS else isinstance(value, str) if key in TEXTS
              else isinstance(value, list) and all(map(_is_number, value))
              if key in NUMBER_LISTS else isinstance(value, dict) and all(
                  isinstance(k, str) and _is_number(v) for k, v in value.items())
              if key in COUNTS else True)
        if not ok:
            raise ValueError(f"{where}.{key} has the wrong type")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def own_reply(message: dict, fingerprint: str) -> bool:
    """A reply the model `fingerprint` generated in full (plain or drafted decoding, greedy
    or sampled): not empty, not stopped part-way (a stopped or interrupted reply has no
    "stats" or stop reason "cancelled"), and not drafted with typical acceptance, which
    keeps draft tokens the model might not have chosen. Replies saved before the model was
    recorded cannot be attributed and are never used."""
    stats = message.get("stats")
    typical = message.get("acceptance") == "typical" and message.get("accel") != "off"
    return (message.get("model") == fingerprint and bool(str(message["content"]).strip())
            and isinstance(stats, dict) and stats.get("stop_reason") != "cancelled"
            and not typical)



def title_from_prompt(prompt: str) -> str:
    """A side-list title from the first prompt: its first line, cut at a word."""
    line = " ".join(prompt.split())
    if len(line) <= TITLE_CHARS:
        return line or "New chat"
    return line[:TITLE_CHARS].rsplit(" ", 1)[0] + "…"


def unique_title(title: str, taken: set[str]) -> str:
    """`title`, or "title (2)", "title (3)"... when another conversation already has it: the
    same question asked twice must not give two entries nobody can tell apart."""
    if title not in taken:
        return title
    return next(f"{title} ({n})" for n in itertools.count(2) if f"{title} ({n})" not in taken)


def matches(conv: Conversation, query: str) -> bool:
    """Whether the conversation's title or any message holds every word of `query` (case
    is ignored)."""
    text = " ".join([conv.title, conv.system, *(str(m["content"]) for m in conv.messages)])
    text = text.casefold()
    return all(word in text for word in query.casefold().split())
