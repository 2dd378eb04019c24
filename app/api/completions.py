"""POST /v1/completions (a plain prompt, or fill-in-the-middle with `suffix`) and POST
/v1/embeddings requests in, checked; errors in OpenAI's shape (app/api/schema.py)."""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass

from app.api import schema
from app.api.schema import ApiError
from app.settings_rules import text_problem
from engine.config import SamplingParams

# Fill-in-the-middle markers, in the prefix-suffix-middle order the models were trained on:
# Qwen2.5-Coder's, then StarCoder's (and the models that took its tokenizer).
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
MAX_LOGPROBS = 5  # the legacy completions endpoint's cap
MAX_INPUTS = 256  # texts one embeddings request may hold


@dataclass(frozen=True)
class TextRequest:
    """A validated POST /v1/completions body."""

    model: str | None
    prompt: str
    suffix: str | None  # fill-in-the-middle: the text after the gap
    params: SamplingParams
    accel: str
    stream: bool
    include_usage: bool
    n: int
    max_tokens_key: str = "max_tokens"
    max_tokens_given: bool = True  # False: up to the context's end (see schema.parse)


def parse_completion(body: object, default_max_tokens: int) -> TextRequest:
    """Check a completions body; raises ApiError(400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise schema.bad("the request body must be a JSON object", None)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise schema.bad("model must be a string", "model")
    prompt = _text(_one(body.get("prompt"), "prompt"), "prompt")
    suffix = body.get("suffix")
    if suffix is not None:
        suffix = _text(suffix, "suffix")
    if body.get("echo") not in (None, False):
        raise schema.bad("echo is not supported by this server: leave it out", "echo")
    if body.get("best_of") not in (None, 1):
        raise schema.bad("best_of is not supported by this server: leave it out", "best_of")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not schema.is_int(logprobs) or
                                 not 0 <= logprobs <= MAX_LOGPROBS):
        raise schema.bad(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}", "logprobs")
    chat_like = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    params = schema.sampling_params(chat_like, default_max_tokens)
    params = dataclasses.replace(params, logprobs=logprobs)
    return TextRequest(model, prompt, suffix, params, schema.accel_of(body),
                       schema.stream_of(body), schema.include_usage(body), schema.n_of(body),
                       "max_tokens", schema.max_tokens_given(body))


def _one(value, key: str):
    """A prompt is a string, or a list holding one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise schema.bad(f"{key} must be a string (or a list of one string)", key)
    return value


def _text(value, key: str) -> str:
    if not isinstance(value, str):
        raise schema.bad(f"{key} must be a string", key)
    if (why := text_problem(value)) is not None:
        raise schema.bad(f"{key} {why}", key)
    return value


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


@dataclass(frozen=True)
class EmbeddingRequest:
    """A validated POST /v1/embeddings body."""

    model: str | None
    texts: tuple[str, ...]
    base64: bool  # encoding_format "base64": float32 little-endian bytes, base64-encoded
    dimensions: int | None


def parse_embeddings(body: object) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise schema.bad("the request body must be a JSON object", None)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise schema.bad("model must be a string", "model")
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or len(texts) > MAX_INPUTS or \
            not all(isinstance(t, str) for t in texts):
        raise schema.bad(f"input must be a string or a list of 1 to {MAX_INPUTS} strings "
                          "(token ids from another tokenizer would not mean the same here)",
                          "input")
    for i, text in enumerate(texts):
        if not text:
            raise schema.bad(f"input[{i}] is empty", "input")
        _text(text, "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise schema.bad("encoding_format must be float or base64", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and not schema.is_int(dimensions):
        raise schema.bad("dimensions must be an integer", "dimensions")
    return EmbeddingRequest(model, tuple(texts), encoding == "base64", dimensions)


def encode_vector(values, as_base64: bool):
    """One embedding as OpenAI sends it: a list of floats, or base64 of float32 bytes."""
    if as_base64:
        return base64.b64encode(values.float().numpy().astype("<f4").tobytes()).decode()
    return values.tolist()
