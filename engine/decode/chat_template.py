"""ChatPrompt -> prompt token ids, through the model's own chat template."""

from __future__ import annotations

from engine.config import ChatMessage, ChatPrompt
from engine.errors import PromptError


def conversation(prompt: str, history: list[dict] | None = None,
                 system: str | None = None) -> ChatPrompt:
    """Build a ChatPrompt from a new user prompt and earlier {'role', 'content'} turns."""
    if not prompt or not prompt.strip():
        raise PromptError("the prompt is empty: type a message first")
    turns = [ChatMessage(h["role"], h["content"]) for h in history or []]
    return ChatPrompt(tuple(turns) + (ChatMessage("user", prompt),), system)


def encode(tokenizer, conv: ChatPrompt) -> list[int]:
    """Token ids of the conversation, ending where the assistant's reply starts (its tools
    rendered by the template, which must support them: `supports_tools`)."""
    messages = [m.as_dict() for m in conv.messages]
    if conv.system:
        messages.insert(0, {"role": "system", "content": conv.system})
    return render(tokenizer, messages, generation_prompt=True, tools=list(conv.tools) or None)


def supports_tools(tokenizer) -> bool:
    """Whether the model's chat template renders tools (it reads the `tools` variable)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    from jinja2 import Environment, meta

    return "tools" in meta.find_undeclared_variables(Environment().parse(template))


def render(tokenizer, messages: list[dict], generation_prompt: bool,
           tools: list[dict] | None = None) -> list[int]:
    """Token ids of {'role', 'content'} messages through the model's chat template, with
    the start of the assistant's reply after them when `generation_prompt`."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True,
            return_dict=True)
        return list(encoded["input_ids"])
    # No template (a base model): a plain transcript the model can continue.
    text = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    text += "\nAssistant:" if generation_prompt else ""
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def fit_to_context(ids: list[int], context_len: int, max_new_tokens: int) -> tuple[list[int], int]:
    """Keep the prompt's most recent tokens so prompt + reply fit the context window.

    Returns (ids, dropped): `dropped` tokens were cut from the start (0 when it fits).
    """
    room = context_len - max_new_tokens
    if room < 1:
        raise PromptError(
            f"max new tokens ({max_new_tokens}) leaves no room for a prompt in this model's "
            f"{context_len}-token context"
        )
    if len(ids) <= room:
        return ids, 0
    return ids[-room:], len(ids) - room
