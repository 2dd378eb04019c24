"""How a drafted reply ends and what it counts: stop strings and EOS inside an accepted
block, the token budget, drafts capped to the room left, random draws on the generator's
device, and the acceptance modes a user can pick."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import verify
from engine.decode.drafter import Draft, Drafter, Session
from engine.decode.generate import run
from engine.errors import QuickdraftError
from tests.conftest import make_tiny_model
from tests.engine.drafters.spy import Spy

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [20, 31, 45, 52, 60, 71, 33, 48]


class Oracle(Drafter, Session):
    """Proposes the next `block` tokens of a known reply: every draft is accepted, so a
    reply ends inside drafted blocks. Records each draft's size and the room it had (its
    own session: it holds nothing a reply changes but that record)."""

    name = "oracle"

    def __init__(self, reply: list[int], block: int = 6):
        self.reply, self.block, self.seen = reply, block, []

    def start(self, state, prefill) -> Session:
        return self

    def propose(self, state) -> Draft:
        done = len(state.ids) - state.prompt_len  # reply tokens chosen so far
        drafted = self.reply[done:done + self.block]
        self.seen.append((len(drafted), state.room))
        return Draft.chain(state.ids[-1], drafted[:state.room])


@pytest.fixture(scope="module")
def tiny(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=100)
    return dataclasses.replace(lm, eos_ids=())


def mid(index: int, block: int = 6) -> bool:
    """Whether reply token `index` falls strictly inside an Oracle block: token 0 comes
    from the prompt, then each step adds block + 1 tokens (ending at 7, 14, ...)."""
    return index % (block + 1) != 0


def plain(lm, params):
    return run(lm, PROMPT, params)


def test_a_stop_string_inside_a_drafted_block_ends_the_reply_where_plain_decoding_does(tiny):
    _t, reply, _s = plain(tiny, SamplingParams(max_new_tokens=40))
    # Two character tokens (ids from 17 on) whose first occurrence in the text ends
    # plain decoding strictly inside an Oracle block.
    for at in range(10, 38):
        if min(reply[at:at + 2]) < 17:
            continue
        params = SamplingParams(max_new_tokens=40, stop=(tiny.tokenizer.decode(reply[at:at + 2]),))
        want_text, want_ids, want = plain(tiny, params)
        if mid(len(want_ids) - 1):
            break
    else:
        pytest.fail("no stop string ends plain decoding inside a block")
    text, ids, stats = run(tiny, PROMPT, params, Oracle(reply))
    assert (text, ids) == (want_text, want_ids)
    assert stats.tokens == want.tokens == len(ids) < 40
    assert stats.stop_reason == "stop"
    # Only the tokens plain decoding emitted count as accepted.
    assert stats.steps + 1 + sum(stats.accepted) == stats.tokens


def test_eos_inside_a_drafted_block_ends_the_reply_and_counts_only_what_was_emitted(tiny):
    _t, reply, _s = plain(tiny, SamplingParams(max_new_tokens=40))
    end = next(j for j in range(9, 40) if reply.index(reply[j]) == j and mid(j))
    lm = dataclasses.replace(tiny, eos_ids=(reply[end],))
    params = SamplingParams(max_new_tokens=40)
    want = run(lm, PROMPT, params)
    _t, ids, stats = run(lm, PROMPT, params, Oracle(reply))
    assert ids == want[1] == reply[:end + 1]
    assert stats.stop_reason == want[2].stop_reason == "eos"
    assert stats.steps + 1 + sum(stats.accepted) == stats.tokens == len(ids)


def test_an_eos_past_the_budget_ends_the_reply_by_length(tiny):
    _t, reply, _s = plain(tiny, SamplingParams(max_new_tokens=40))
    eos = reply[20]
    first = reply.index(eos)
    lm = dataclasses.replace(tiny, eos_ids=(eos,))
    params = SamplingParams(max_new_tokens=first)  # the EOS would be token first + 1
    # The oracle's blocks of 6 reach past the budget: the EOS is in the last verified block.
    _t, ids, stats = run(lm, PROMPT, params, Oracle(reply, block=40))
    assert ids == reply[:first]
    assert stats.stop_reason == "length"
    assert stats.steps + 1 + sum(stats.accepted) == stats.tokens == first


@pytest.mark.parametrize("method", ["oracle", "lookup", "medusa"])
def test_drafts_never_reach_past_the_budget(tiny, method):
    from engine.drafters.lookup import LookupDrafter
    from tests.engine.drafters.medusa import test_medusa as md

    budget = 30
    _t, reply, _s = plain(tiny, SamplingParams(max_new_tokens=budget))
    drafter = {"oracle": lambda: Oracle(reply, block=8), "lookup": LookupDrafter,
               "medusa": lambda: md.medusa(tiny, md.random_heads(tiny))}[method]()
    depths = []

    def recording(state, draft, path, session):
        depths.append((len(state.ids) - state.prompt_len, max(draft.depths)))

    drafter = Spy(drafter, recording)
    prompt = PROMPT + reply[:12]  # lookup finds the reply's own continuation
    _t, ids, _s = run(tiny, prompt if method == "lookup" else PROMPT,
                      SamplingParams(max_new_tokens=budget), drafter)
    assert len(ids) == budget
    # A draft at depth d would be token done + d + 1 with the step's own token after it.
    assert all(depth <= budget - done - 1 for done, depth in depths)
    assert max(depth for _d, depth in depths) > 0


def test_random_draws_use_the_generators_device(monkeypatch):
    """torch refuses a CUDA generator for a tensor made on the CPU, so every uniform draw
    of the acceptance rules must be made on the generator's device."""
    seen = []
    real = torch.rand

    def recording(*args, generator=None, device=None, **kwargs):
        seen.append((generator.device if generator is not None else None, device))
        return real(*args, generator=generator, device=device, **kwargs)

    monkeypatch.setattr(torch, "rand", recording)
    gen = torch.Generator(device="cpu").manual_seed(0)
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    verify.accept_pointmass([[1], []], [0, 1], probs, gen)
    verify.accept_speculative_chain([0, 2], torch.tensor([[0.2, 0.2, 0.6]]), probs, gen)
    assert len(seen) >= 2
    assert all(device is not None and torch.device(device) == g for g, device in seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_acceptance_rules_run_with_a_cuda_generator():
    gen = torch.Generator(device="cuda").manual_seed(0)
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]], device="cuda")
    results = [verify.accept_pointmass([[1], []], [0, 1], probs, gen),
               verify.accept_speculative_chain([0, 2], probs[:1], probs, gen),
               verify.accept_typical([[1], []], [0, 1], probs, 0.09, 0.3, gen)]
    drafted = [[1], [2], [1]]  # each rule's draft after the root
    for (accepted, token), draft in zip(results, drafted, strict=True):
        assert accepted in ([], draft) and 0 <= int(token) < 3


def test_greedy_acceptance_while_sampling_is_refused():
    with pytest.raises(QuickdraftError, match="greedy acceptance needs temperature 0"):
        SamplingParams(temperature=0.7, acceptance="greedy")
    assert SamplingParams(acceptance="greedy").acceptance_mode == "greedy"
    assert SamplingParams(temperature=0.7).acceptance_mode == "lossless"
    assert SamplingParams(temperature=0.7, acceptance="typical").acceptance_mode == "typical"
    assert SamplingParams(acceptance="typical").acceptance_mode == "greedy"  # T = 0


def _probs(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_typical_acceptance_keeps_the_longest_acceptable_path():
    # Root's children: node 1 (token 0, p 0.5) and node 2 (token 1, p 0.4), both acceptable.
    # Only node 2 has an acceptable child (node 3), so the longest path is 2 -> 3, not the
    # first acceptable child.
    children = [[1, 2], [], [3], []]
    tokens = [9, 0, 1, 2]
    probs = _probs([0.5, 0.4, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25],
                   [0.0, 0.0, 0.95, 0.05], [0.25, 0.25, 0.25, 0.25])
    gen = torch.Generator().manual_seed(0)
    path, _next = verify.accept_typical(children, tokens, probs, 0.09, 0.3, gen)
    assert path == [2, 3]


def test_the_typical_threshold_is_what_decides():
    """p(x) > min(eps, delta * exp(-H)): the same probability is accepted under a flat
    distribution (high entropy, low threshold) and refused under a peaked one."""
    gen = torch.Generator().manual_seed(0)
    flat = torch.full((1, 20), 1 / 20)  # H = ln 20: delta * exp(-H) = 0.3 / 20 = 0.015
    assert verify.accept_typical([[1], []], [0, 3], torch.cat([flat, flat]), 0.09, 0.3, gen)[0] == [1]
    peaked = torch.tensor([[0.05, 0.95], [0.5, 0.5]])  # H ~ 0.199: threshold min(0.09, 0.246)
    h = -(0.05 * math.log(0.05) + 0.95 * math.log(0.95))
    assert min(0.09, 0.3 * math.exp(-h)) == 0.09
    assert verify.accept_typical([[1], []], [0, 0], peaked, 0.09, 0.3, gen)[0] == []  # 0.05
    assert verify.accept_typical([[1], []], [0, 0], peaked, 0.04, 0.3, gen)[0] == [1]  # eps 0.04
