"""The prompt is read in chunks (engine.decode.generate.PREFILL_CHUNK tokens a forward): a cancel
set while a long prompt is read stops the reply at the next chunk, not after the whole
prompt, and the chunks change no token: greedy decoding, plain or drafting with sources
that read the prompt's hidden states, gives what one forward over the prompt gives."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import generate as loop
from engine.decode.generate import generate, run
from tests.conftest import assert_exact_while_drafting, make_tiny_model
from tests.engine.drafters.test_composite import kangaroo_of, medusa_of

pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK = 8


@pytest.fixture(scope="module")
def lm(bundled_tokenizer):
    return make_tiny_model("llama-mha", bundled_tokenizer, vocab_size=64)


def _prompt(n: int, seed: int = 3) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, 64, (n,), generator=gen)]


def test_a_cancel_while_the_prompt_is_read_stops_at_the_next_chunk(lm, monkeypatch):
    monkeypatch.setattr(loop, "PREFILL_CHUNK", CHUNK)
    cancel = threading.Event()
    chunks = []
    forward = lm.target.forward

    def counted(cache, tokens, start, *args, **kwargs):
        chunks.append(len(tokens))
        if len(chunks) == 2:  # the client hangs up while the second chunk runs
            cancel.set()
        return forward(cache, tokens, start, *args, **kwargs)

    monkeypatch.setattr(lm.target, "forward", counted)
    events = list(generate(lm, _prompt(12 * CHUNK), SamplingParams(max_new_tokens=8),
                           cancel=cancel))
    assert chunks == [CHUNK, CHUNK]  # not the twelve chunks of the whole prompt
    assert len(events) == 1 and events[0].done and events[0].token_ids == []
    assert events[0].stats.stop_reason == "cancelled" and events[0].stats.tokens == 0


def test_chunks_change_no_token(lm, monkeypatch):
    prompt, params = _prompt(5 * CHUNK + 3), SamplingParams(max_new_tokens=24)
    whole = run(lm, prompt, params)[1]
    monkeypatch.setattr(loop, "PREFILL_CHUNK", CHUNK)
    assert run(lm, prompt, params)[1] == whole


@pytest.mark.parametrize("drafter", [medusa_of, kangaroo_of])
def test_drafters_that_read_the_prompt_states_stay_exact_over_chunks(lm, monkeypatch, drafter):
    monkeypatch.setattr(loop, "PREFILL_CHUNK", CHUNK)
    assert_exact_while_drafting(lm, _prompt(4 * CHUNK + 5), SamplingParams(max_new_tokens=24),
                                drafter(lm))
