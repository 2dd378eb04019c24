"""The decode loop against Hugging Face generate(), plus cancel, stop strings and streaming."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import SamplingParams
from engine.decode.chat_template import conversation, encode, fit_to_context
from engine.decode.generate import generate, run
from engine.decode.textstream import TextStream
from engine.errors import PromptError
from tests.conftest import make_tiny_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning, my friend' into German.",
]


def hf_greedy(lm, ids, max_new_tokens):
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=list(lm.eos_ids), pad_token_id=lm.eos_ids[0])
    return out[0, len(ids):].tolist()


def test_plain_loop_matches_generate_on_tiny_configs(tiny_lm):
    ids = encode(tiny_lm.tokenizer, conversation("Hello there, how are you?"))
    _text, got, stats = run(tiny_lm, ids, SamplingParams(max_new_tokens=64))
    assert got == hf_greedy(tiny_lm, ids, 64)
    assert stats.steps == stats.tokens - 1
    assert stats.mean_accepted == 1.0


@pytest.mark.slow
def test_plain_loop_matches_generate_on_bundled_model(bundled_lm):
    for prompt in PROMPTS:
        ids = encode(bundled_lm.tokenizer, conversation(prompt))
        _text, got, _stats = run(bundled_lm, ids, SamplingParams(max_new_tokens=64))
        assert got == hf_greedy(bundled_lm, ids, 64), prompt


def test_cancel_keeps_partial_text(bundled_tokenizer):
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    cancel = threading.Event()
    events = []
    for event in generate(lm, [1, 2, 3], SamplingParams(max_new_tokens=200), cancel=cancel):
        events.append(event)
        if event.tokens >= 10:
            cancel.set()
    last = events[-1]
    assert last.done and last.stats.stop_reason == "cancelled"
    assert 10 <= last.stats.tokens <= 11  # ends within one step of the request
    assert last.full_text == "".join(e.text for e in events)


def test_eos_ends_generation(bundled_tokenizer):
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    _text, ids, _ = run(lm, [1, 2, 3], SamplingParams(max_new_tokens=30))
    lm.eos_ids = (ids[4],)  # pretend the fifth token is the end of the reply
    _text, ids2, stats = run(lm, [1, 2, 3], SamplingParams(max_new_tokens=30))
    assert ids2 == ids[: ids.index(ids[4]) + 1]
    assert stats.stop_reason == "eos"


class CharTokenizer:
    """Decodes ids as UTF-8 bytes: lets tests split characters and stop strings anywhere."""

    def __init__(self, data: bytes):
        self.data = data

    def decode(self, ids, skip_special_tokens=True):
        return bytes(self.data[i] for i in ids).decode("utf-8", errors="replace")


def _stream_all(text: str, stop=(), chunk=1):
    data = text.encode("utf-8")
    tok = CharTokenizer(data)
    stream = TextStream(tok, stop)
    out = []
    ids = list(range(len(data)))
    for i in range(0, len(ids), chunk):
        out.append(stream.push(ids[i:i + chunk]))
        if stream.stopped:
            break
    out.append(stream.flush())
    return out


def test_multibyte_characters_stream_intact():
    text = "Grüße 👋 from 東京, naïve café"
    for chunk in (1, 2, 3):
        pieces = _stream_all(text, chunk=chunk)
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)


def test_stop_string_never_half_emitted():
    pieces = _stream_all("Answer: 42\nUser: next question", stop=("\nUser:",))
    assert "".join(pieces) == "Answer: 42"
    assert all("\nUs" not in p and not p.endswith("\n") for p in pieces)


def test_partial_stop_prefix_is_released_at_the_end():
    pieces = _stream_all("tail ends with \nUs", stop=("\nUser:",))
    assert "".join(pieces) == "tail ends with \nUs"


def test_stop_string_ends_generation(bundled_tokenizer):
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3)  # varied text
    text, _ids, _ = run(lm, [1, 2, 3], params)
    stop = text[15:19]
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3, stop=(stop,))
    text2, _ids2, stats = run(lm, [1, 2, 3], params)
    assert stats.stop_reason == "stop"
    assert text2 == text[: text.index(stop)]


def test_empty_prompt_is_refused():
    with pytest.raises(PromptError):
        conversation("   ")


def test_long_prompt_keeps_most_recent_tokens(bundled_tokenizer):
    ids, dropped = fit_to_context(list(range(1000)), context_len=512, max_new_tokens=12)
    assert dropped == 500 and ids == list(range(500, 1000))
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    events = list(generate(lm, list(range(5, 700)), SamplingParams(max_new_tokens=12)))
    assert events[0].notices and "dropped" in events[0].notices[0]
    assert events[-1].stats.prompt_dropped == 695 - 500
    with pytest.raises(PromptError):
        fit_to_context([1, 2], context_len=512, max_new_tokens=512)
