"""POST /v1/completions (a plain prompt, or fill-in-the-middle with `suffix`) and POST
/v1/embeddings bodies as pydantic models (app/api/schema.py); errors in OpenAI's shape."""

from __future__ import annotations

import base64
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator

from app.api.errors import ApiError
from app.api.schema import Sampling, Strict, Text, valid_text, within

# Fill-in-the-middle markers, in the prefix-suffix-middle order the models were trained on:
# Qwen2.5-Coder's, then StarCoder's (and the models that took its tokenizer).
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
MAX_LOGPROBS = 5  # the legacy completions endpoint's cap
MAX_INPUTS = 256  # texts one embeddings request may hold


def _one(value: Any) -> str:
    """A prompt is a string, or a list holding one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise ValueError("must be a string (or a list of one string)")
    return valid_text(value)


class TextRequest(Sampling):
    """POST /v1/completions."""

    unsupported: ClassVar[dict[str, tuple]] = {"echo": (None, False), "best_of": (None, 1)}

    prompt: Annotated[Any, AfterValidator(_one)]
    suffix: Text | None = None  # fill-in-the-middle: the text after the gap
    logprobs: Annotated[int, within(0, MAX_LOGPROBS)] | None = None


def prompt_ids(tokenizer, req: TextRequest) -> list[int]:
    """The prompt's token ids: the text itself, or with `suffix` the model's own
    fill-in-the-middle layout (400 for a model without those tokens)."""
    if req.suffix is None:
        return list(tokenizer(req.prompt)["input_ids"])
    vocab = tokenizer.get_vocab()
    for prefix, suffix, middle in FIM_TOKENS:
        if all(t in vocab for t in (prefix, suffix, middle)):
            text = f"{prefix}{req.prompt}{suffix}{req.suffix}{middle}"
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    raise ApiError(400, "suffix needs a model with fill-in-the-middle tokens "
                   "(<|fim_prefix|>... or <fim_prefix>...): this one has none", "suffix",
                   "unsupported_value")


def _inputs(value: Any) -> tuple[str, ...]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not 0 < len(texts) <= MAX_INPUTS or \
            not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"must be a non-empty string or a list of 1 to {MAX_INPUTS} of "
                         "them (token ids from another tokenizer would not mean the same here)")
    return tuple(valid_text(t) for t in texts)


class EmbeddingRequest(Strict):
    """POST /v1/embeddings."""

    model: str | None = None
    input: Annotated[Any, AfterValidator(_inputs)]  # the texts, each embedded
    encoding_format: Literal["float", "base64"] = "float"  # base64: float32 little-endian
    dimensions: int | None = None  # the model's own size or none

    @property
    def base64(self) -> bool:
        return self.encoding_format == "base64"


def encode_vector(values, as_base64: bool):
    """One embedding as OpenAI sends it: a list of floats, or base64 of float32 bytes."""
    if as_base64:
        return base64.b64encode(values.float().numpy().astype("<f4").tobytes()).decode()
    return values.tolist()
