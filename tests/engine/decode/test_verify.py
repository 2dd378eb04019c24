"""The sampling acceptance rules on their own: the distribution of what they emit, and
that each decides on the device with one read of it per step."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import verify
from engine.decode.sampling import logits_to_probs
from tests.stats_util import chi_square_pvalue

# scripts/gpu_check.py runs these on a GPU, where a read of the device costs a wait
DEVICE = torch.device(os.environ.get("QUICKDRAFT_TEST_DEVICE", "cpu"))
V = 4
# Root (pending token 0) with children: node 1 (token 1), node 2 (token 1 again: a
# repeated guess has nothing left once token 1 was refused) and node 3 (token 2); node 1's
# children are node 4 (token 0) and node 5 (token 3); node 4's child node 6 (token 2).
CHILDREN = [[1, 2, 3], [4, 5], [], [], [6], [], []]
TOKENS = [0, 1, 1, 2, 0, 3, 2]
TAKES = {1: 1, 2: 3}  # the first emitted token -> the node it reaches


def _probs(seed: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, V, generator=gen) ** 2).to(DEVICE)


def _normed(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum(-1, keepdim=True)


def _pairs(rule, runs: int) -> torch.Tensor:
    """Counts of (first emitted token, second emitted token or none) over `runs` steps."""
    counts = torch.zeros(V, V + 1)
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    for _ in range(runs):
        emitted = rule(gen)
        counts[emitted[0], emitted[1] if len(emitted) > 1 else V] += 1
    return counts.flatten()


def _exact_pairs(first: torch.Tensor, second: dict[int, torch.Tensor]) -> torch.Tensor:
    """P(t1, t2): t1 ~ first; where t1 leads into the tree, t2 ~ that node's row."""
    exact = torch.zeros(V, V + 1)
    for t1 in range(V):
        if t1 in second:
            exact[t1, :V] = first[t1] * second[t1]
        else:
            exact[t1, V] = first[t1]
    return exact.flatten().cpu()


def _tree_rule(probs, at_once):
    def rule(gen):
        path, nxt = verify.accept_pointmass(CHILDREN, TOKENS, probs, gen, at_once)
        return [TOKENS[i] for i in path] + [nxt]
    return rule


BOTH = pytest.mark.parametrize("at_once", [True, False], ids=["at-once", "in-turn"])


@BOTH
def test_a_tree_emits_exactly_the_target_distribution(at_once):
    probs = _normed(_probs(1, len(TOKENS)))
    exact = _exact_pairs(probs[0], {t: probs[node] for t, node in TAKES.items()})
    assert chi_square_pvalue(_pairs(_tree_rule(probs, at_once), 6000), exact) > 1e-3


@BOTH
def test_a_tree_whose_children_take_all_the_mass_still_samples_exactly(at_once):
    """Top-k style rows: the root's children cover every token with mass, so the token
    after a full refusal comes from nothing that was refused."""
    probs = _normed(_probs(2, len(TOKENS)))
    probs[0] = torch.tensor([0.0, 0.7, 0.3, 0.0], device=DEVICE)  # tokens 1, 2: both drafted
    exact = _exact_pairs(probs[0], {t: probs[node] for t, node in TAKES.items()})
    assert chi_square_pvalue(_pairs(_tree_rule(probs, at_once), 4000), exact) > 1e-3


@BOTH
def test_one_hot_rows_follow_the_target_down_the_tree(at_once):
    """A point-mass target: the rule keeps exactly the nodes greedy acceptance keeps."""
    want = [1, 0, 2, 1, 2, 3, 1]  # each node's next token under the target
    probs = torch.nn.functional.one_hot(torch.tensor(want, device=DEVICE), V).float()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    assert verify.accept_pointmass(CHILDREN, TOKENS, probs, gen, at_once) == ([1, 4, 6], 1)
    assert verify.accept_greedy(CHILDREN, TOKENS, want) == ([1, 4, 6], 1)


@BOTH
def test_a_chain_drafted_from_q_emits_exactly_the_target_distribution(at_once):
    """Drafts sampled from q: the first token emitted follows p_0 and, where the first
    draft was kept, the second follows p_1 (the row after it)."""
    probs = _normed(_probs(3, 3))
    q = _normed(_probs(4, 2))
    firsts, seconds = torch.zeros(V), torch.zeros(V)
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    for _ in range(6000):
        drafted = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
        path, nxt = verify.accept_speculative_chain([0, *drafted], q, probs, gen, at_once)
        emitted = [drafted[i - 1] for i in path] + [nxt]
        firsts[emitted[0]] += 1
        if len(emitted) > 1:
            seconds[emitted[1]] += 1
    assert chi_square_pvalue(firsts, probs[0].cpu()) > 1e-3
    assert chi_square_pvalue(seconds, probs[1].cpu()) > 1e-3


class _Reads:
    """Counts the ways a tensor's values reach the host."""

    WAYS = ("tolist", "item", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for way in self.WAYS:
            real = getattr(torch.Tensor, way)
            monkeypatch.setattr(torch.Tensor, way, self._counting(real))

    def _counting(self, real):
        def read(tensor, *args):
            self.count += 1
            return real(tensor, *args)
        return read


@pytest.mark.parametrize("rule", ["pointmass", "chain"])
def test_a_sampled_step_reads_the_device_once(rule, monkeypatch):
    """On a GPU every read of a value waits for the queued kernels: a step's acceptance
    decides on the device and reads its outcome once (at once: a GPU's way)."""
    probs = _normed(_probs(5, len(TOKENS)))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    reads = _Reads(monkeypatch)
    if rule == "pointmass":
        verify.accept_pointmass(CHILDREN, TOKENS, probs, gen, at_once=True)
    else:
        verify.accept_speculative_chain([0, 2, 1, 3], probs[:3], probs[:4], gen, at_once=True)
    assert reads.count == 1


def test_rules_try_in_turn_on_a_cpu_only():
    """A CPU's reads cost nothing and trying in turn stops early; any other device draws
    every trial at once."""
    assert not verify._at_once(torch.zeros(1), None)
    assert verify._at_once(torch.zeros(1, device="meta"), None)
    assert verify._at_once(torch.zeros(1), True) and not verify._at_once(torch.zeros(1), False)


def test_a_cpu_step_shapes_only_the_rows_its_rule_reaches():
    """Trying candidates in turn reads the rows of the nodes it reaches: a chain whose
    first draft the target gives no chance shapes the root's row alone, and the rows it
    does shape are the ones shaping every row at once gives."""
    params = SamplingParams(temperature=0.7, top_p=0.9)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    logits[0, 7] = float("-inf")  # the first draft, token 7, has no chance
    rows = verify.probabilities(logits, params)
    chain = [[i + 1] for i in range(5)] + [[]]
    path, _ = verify.accept_pointmass(chain, [1, 7, 8, 9, 10, 11], rows,
                                      torch.Generator().manual_seed(0))
    assert path == [] and list(rows.made) == [0]
    assert torch.equal(rows[3], logits_to_probs(logits, params)[3])
