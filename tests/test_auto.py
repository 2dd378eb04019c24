"""Auto: which arm each step takes from calibration and live figures, trying the others now
and then, its fallback to Off, the figures it keeps per model and machine, exact greedy
replies and consistent caches while it mixes Medusa, Kangaroo and lookup within one reply,
lossless sampling, and the registry building it from whatever is trained."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from engine.config import SamplingParams
from engine.drafters.auto import AutoDrafter, accepted_length, adapter_kept
from engine.drafters.auto_figures import (
    COPY,
    MATCH,
    NO_MATCH,
    AutoPolicy,
    Figure,
    load_figures,
    priors,
)
from engine.drafters.base import Draft
from engine.drafters.kangaroo import (
    Adapter,
    KangarooDrafter,
    KangarooSettings,
)
from engine.drafters.kangaroo_adapter import sequence_states
from engine.drafters.lookup import LookupParams
from engine.drafters.medusa import MedusaDrafter
from engine.drafters.registry import auto_figures_path, load_drafter
from engine.errors import AcceleratorError
from engine.generate import run
from engine.stats import GenerationStats
from engine.tree import build_tree
from tests import test_kangaroo as kg
from tests import test_medusa as md
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.stats_util import chi_square_pvalue
from tests.test_hybrid import break_pointmass, repetitive_prompt

pytestmark = pytest.mark.usefixtures("one_thread")


def drafters(lm, medusa=True, kangaroo=True, exit_layer=2, gamma=4, seed=0):
    """Random Medusa heads and a random Kangaroo adapter (eta 0: it drafts gamma tokens)."""
    torch.manual_seed(seed)
    m = MedusaDrafter(lm, md.random_heads(lm, seed=seed + 1), build_tree(md.TREE, 4)) \
        if medusa else None
    k = KangarooDrafter(lm, Adapter(lm.model), KangarooSettings(exit_layer, 0.0, gamma)) \
        if kangaroo else None
    return m, k


def make_auto(lm, speedups: dict[str, float], path=None, cls=AutoDrafter, lookup=None,
              **policy):
    m, k = drafters(lm, "medusa+lookup" in speedups, "kangaroo" in speedups)
    return cls(load_figures(path, priors(0.01, speedups)), m, k, path, AutoPolicy(**policy),
               lookup)


@pytest.fixture(scope="module")
def tiny(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    return lm


def simulate(a: AutoDrafter, kind: str, truth: dict[str, tuple[float, float]],
             steps: int, pace: float = 1.0) -> list[str]:
    """`steps` steps of one kind: the arm taken is timed, every arm's tokens are counted
    (as the reply shows them); truth: arm -> (tokens per round, seconds), every arm's
    seconds times `pace` (the machine's speed just now). Arms taken."""
    taken = []
    for _ in range(steps):
        arm = a._choose(kind)
        a.pace.time(a.figures[kind][arm], truth[arm][1] * pace, a.policy)
        for name, (tokens, _s) in truth.items():
            a.figures[kind][name].add_tokens(tokens, a.policy)
        taken.append(arm)
    return taken


# -- choosing ---------------------------------------------------------------------------


def test_each_step_takes_the_fastest_arm_and_times_the_others_now_and_then(tiny):
    a = make_auto(tiny, {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.5,
                         "kangaroo": 1.2}, explore_every=20)
    assert a.arms[NO_MATCH] == ("off", "medusa+lookup", "kangaroo")
    truth = {"off": (1.0, 0.010), "medusa+lookup": (1.6, 0.0123),
             "kangaroo": (1.5, 0.0136)}  # 100, 130, 110 tokens/s
    taken = simulate(a, NO_MATCH, truth, 100)
    # Never timed: each arm once, best estimate first; then the fastest, with every other
    # arm timed again 8 steps later until it has 3 rounds, then once per 20 steps.
    assert taken[:3] == ["medusa+lookup", "kangaroo", "off"]
    off = [i for i, arm in enumerate(taken) if arm == "off"]
    assert [b - a for a, b in zip(off, off[1:], strict=False)] == [8, 8, 20, 20, 20, 20]
    assert Counter(taken)["medusa+lookup"] >= 85
    assert a.figures[NO_MATCH]["medusa+lookup"].tok_s == pytest.approx(130.0, rel=1e-3)
    assert a.figures[MATCH]["lookup"].rounds == 0  # the kinds keep their own figures


def test_live_figures_switch_arms_and_fall_back_to_off(tiny):
    a = make_auto(tiny, {"off": 1.0, "lookup": 1.1, "kangaroo": 1.4})
    truth = {"lookup": (1.1, 0.012), "off": (1.0, 0.010), "kangaroo": (1.8, 0.013)}
    first = simulate(a, MATCH, truth, 30)
    assert Counter(first[3:]) == {"kangaroo": 23, "lookup": 2, "off": 2}  # re-timed
    # The reply turns to text the adapter does not guess: Off takes over within steps.
    truth["kangaroo"] = (1.0, 0.013)
    later = simulate(a, MATCH, truth, 40)
    assert "kangaroo" in later[:3] and Counter(later[-30:])["off"] >= 29  # 1 re-timing


def test_a_reply_takes_another_arm_only_when_it_is_clearly_ahead(tiny):
    """A reply's running means are noisy: an arm a few percent ahead of the long-run best in
    this reply does not take over; one ahead by more than the switch margin does."""
    a = make_auto(tiny, {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.5,
                         "kangaroo": 1.2})
    truth = {"off": (1.0, 0.010), "medusa+lookup": (1.6, 0.0123),
             "kangaroo": (1.5, 0.0136)}  # 100, 130, 110 tokens/s
    simulate(a, NO_MATCH, truth, 100)
    truth["kangaroo"] = (1.85, 0.0136)  # 136 tokens/s: 5% ahead
    # Medusa keeps the steps (room left for re-timing Off and the adapter).
    assert Counter(simulate(a, NO_MATCH, truth, 40))["medusa+lookup"] >= 38
    truth["kangaroo"] = (2.3, 0.0136)  # 169 tokens/s: 30% ahead
    taken = simulate(a, NO_MATCH, truth, 20)
    assert Counter(taken[3:])["kangaroo"] >= 16  # 1 re-timing


def test_arms_timed_at_another_pace_are_compared_at_todays(tiny):
    """The machine (or a shorter context) runs every arm 40% faster while Off runs: Off's
    fresh timings must not beat the adapter's older ones once the adapter guesses well."""
    a = make_auto(tiny, {"off": 1.0, "lookup": 1.1, "kangaroo": 1.4})
    truth = {"lookup": (1.1, 0.012), "off": (1.0, 0.010), "kangaroo": (1.5, 0.0136)}
    assert Counter(simulate(a, MATCH, truth, 30)[5:])["kangaroo"] >= 20
    truth["kangaroo"] = (1.0, 0.0136)  # text the adapter does not guess, faster pace
    assert Counter(simulate(a, MATCH, truth, 30, pace=0.6)[-20:])["off"] == 20
    assert a.pace.factor == pytest.approx(0.6, rel=0.05)
    # It guesses better than ever: taken as soon as its running tokens put it the switch
    # margin ahead of Off (the long-run best now; 6 steps at weight 0.15), though its last
    # timing is 30 steps old and at the slower pace; compared by raw seconds, Off (at the
    # faster pace) would win until the adapter is timed again.
    truth["kangaroo"] = (1.8, 0.0136)
    taken = simulate(a, MATCH, truth, 20, pace=0.6)
    assert taken == ["off"] * 6 + ["kangaroo"] * 14


def test_each_reply_starts_from_the_figures_over_all_replies(tiny):
    a = make_auto(tiny, {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.5})
    fig = a.figures[NO_MATCH]["medusa+lookup"]
    for _ in range(60):
        fig.add_tokens(3, a.policy)
    for _ in range(12):  # a reply whose text the heads do not guess
        fig.add_tokens(1, a.policy)
    assert fig.recent < 1.4 and fig.tokens > 2.5  # the reply's mean follows, the long one holds
    a.start(None, None)  # the next reply (no Kangaroo state to set up)
    assert fig.recent == fig.tokens


def test_counting_reproduces_what_rounds_kept(bundled_tokenizer):
    """What Auto counts for an arm at a step equals what a round of it kept there: Medusa's
    and lookup's drafts walked along the reply, the adapter's teacher-forced guesses."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    speedups = {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.2, "kangaroo": 1.3}
    a = make_auto(lm, speedups, cls=Rounds, explore_every=2)
    a.kangaroo.settings = KangarooSettings(2, 0.3, 4)  # stops on unsure guesses too
    _t, ids, _s = run(lm, repetitive_prompt(64), SamplingParams(max_new_tokens=60), a)
    full = repetitive_prompt(64) + ids
    with torch.inference_mode():
        hidden = lm.model(input_ids=torch.tensor([full]), output_hidden_states=True)
        read = sequence_states(lm.model, a.kangaroo.adapter, hidden.hidden_states[2])[0]
        probs = torch.softmax(nn.functional.linear(read, a.kangaroo.head).float(), -1)
    top, guess = probs.max(-1)
    guesses = dict(enumerate(zip(guess.tolist(), (top > 0.3).tolist(), strict=True)))
    checked = Counter()
    for arm, root, draft, kept in a.rounds:
        if arm == "kangaroo":
            got = adapter_kept(guesses, full, root, 4)
        else:
            got = accepted_length(draft, full, root)
        assert got == kept, (arm, root)
        checked[arm] += 1
    assert all(checked[arm] > 0 for arm in speedups if arm != "lookup")


def test_accepted_length_walks_the_deepest_agreeing_branch():
    # root -> a(1) -> b(3); root -> a(2) -> c(4) -> d(5)
    draft = Draft([0, 7, 7, 8, 9, 6], [[1, 2], [3], [4], [], [5], []], [0, 1, 1, 2, 2, 3])
    assert accepted_length(draft, [3, 0, 7, 9, 6, 1], 1) == 3
    assert accepted_length(draft, [0, 7, 8, 2], 0) == 2
    assert accepted_length(draft, [0, 5], 0) == 0
    assert accepted_length(draft, [0, 7, 9], 0) is None  # d's turn is not known yet


def test_copy_rounds_leave_the_arms_figures_alone(tiny):
    # Matches of a single token count as copies here: a random tiny model copies no longer.
    single = LookupParams(max_ngram=1, min_ngram=1)
    a = make_auto(tiny, {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.5}, lookup=single)
    run(tiny, repetitive_prompt(64), SamplingParams(max_new_tokens=40), a)
    assert a.last_reply[COPY] >= 1
    timed = sum(f.rounds for arms in a.figures.values() for f in arms.values())
    rounds = sum(a.last_reply.values()) - a.last_reply[COPY]
    assert rounds - 1 <= timed <= rounds  # a reply's last round is not timed


def test_the_reason_names_the_arms_and_the_gain(tiny):
    a = make_auto(tiny, {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.6})
    assert a.current == "medusa+lookup"
    assert a.reason().startswith("Auto starts with Medusa+lookup: 1.60x Off estimated from "
                                 "calibration")
    a.used = Counter({"medusa+lookup": 6, "lookup": 3, COPY: 1})  # as a reply leaves it
    a.finish(GenerationStats(tokens=21, ttft_s=0.1, elapsed_s=0.2))  # 200 tok/s vs Off's 100
    assert a.reason() == "Auto drafted Medusa+lookup 60%, Lookup 30%, copying 10% of the " \
                         "steps; 2.00x Off"
    assert a.current == "medusa+lookup"


def test_measured_figures_persist_and_a_corrupt_file_is_ignored(tiny, tmp_path, caplog):
    path = tmp_path / "auto" / "cpu-bf16.json"
    speedups = {"off": 1.0, "lookup": 1.1}
    a = make_auto(tiny, speedups, path)
    a.figures[MATCH]["lookup"].add_tokens(3, a.policy)
    a.figures[MATCH]["lookup"].add_seconds(0.02, a.policy)
    a.finish(GenerationStats(tokens=1))
    again = load_figures(path, priors(0.01, speedups))
    assert again[MATCH]["lookup"] == Figure(3, 0.02, 1, 1)
    assert again[NO_MATCH]["off"] == Figure(1.0, 0.01)  # never measured: not saved
    path.write_text("{not json")
    assert load_figures(path, priors(0.01, speedups)) == priors(0.01, speedups)
    assert "unreadable" in caplog.text


# -- exactness, caches, sampling ---------------------------------------------------------


class Rounds(AutoDrafter):
    """Auto keeping (arm, root position, draft, drafts kept) for every non-copy round."""

    rounds: list

    def commit(self, state, draft, path):
        if not hasattr(self, "rounds"):
            self.rounds = []
        if self._round.arm != COPY:
            self.rounds.append((self._round.arm, state.cached, draft, len(path)))
        super().commit(state, draft, path)


class Counting(AutoDrafter):
    """Auto counting which arm each step took, over every reply."""

    def start(self, state, prefill):
        super().start(state, prefill)
        self.all_steps = getattr(self, "all_steps", Counter())

    def commit(self, state, draft, path):
        self.all_steps[self._round.arm] += 1
        super().commit(state, draft, path)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_replies_stay_exact_while_arms_switch_every_step(name, bundled_tokenizer):
    lm = make_tiny_model(name, bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    speedups = {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.2, "kangaroo": 1.3}
    a = make_auto(lm, speedups, cls=Counting, explore_every=2)  # rotates through the arms
    params = SamplingParams(max_new_tokens=40)
    for prompt in (repetitive_prompt(64), [9, 8, 7, 6], repetitive_prompt(64, seed=4)):
        assert run(lm, prompt, params, a)[1] == run(lm, prompt, params)[1]
    assert set(a.all_steps) >= {"off", "lookup", "medusa+lookup", "kangaroo"}


class Recording(kg.recording(AutoDrafter)):
    """Auto exposing its Kangaroo drafter's state to the cache check."""

    @property
    def run(self):
        return self.kangaroo.run

    @property
    def settings(self):
        return self.kangaroo.settings

    @property
    def adapter(self):
        return self.kangaroo.adapter


@pytest.mark.parametrize("exit_layer", [1, 2])
def test_every_cache_matches_one_by_one_decoding_whatever_the_arms(
        exit_layer, bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("qwen2", bundled_tokenizer, vocab_size=12)  # tokens recur often
    lm.eos_ids = ()
    m, k = drafters(lm, exit_layer=exit_layer)
    figures = priors(0.01, {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.2,
                            "kangaroo": 1.3})
    a = Recording(figures, m, k, policy=AutoPolicy(explore_every=2))
    kept = kg.check_caches_after_random_accepts(lm, a, [5, 6, 7, 8, 9] * 3, monkeypatch)
    assert max(kept) > 1  # Medusa and lookup rounds left states for the adapter
    assert set(a.last_reply) >= {"medusa+lookup", "kangaroo", "off"}


def test_sampling_is_lossless_and_the_test_catches_a_broken_rule(bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=kg.VOCAB, num_layers=3)
    lm.eos_ids = ()
    prompt = [1, 4, 2, 5, 1, 4]  # (1, 4) recurs: lookup drafts too
    m, k = drafters(lm, exit_layer=1, gamma=3, seed=3)
    figures = priors(0.01, {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.2,
                            "kangaroo": 1.3})
    a = Counting(figures, m, k, policy=AutoPolicy(explore_every=2))
    exact = kg._exact_joint(lm, prompt)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, a, 800), exact) > 1e-3
    assert len(a.all_steps) >= 4  # the arms took turns
    break_pointmass(monkeypatch)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, a, 800), exact) < 1e-3


# -- the registry ------------------------------------------------------------------------


def test_registry_builds_auto_from_what_is_trained(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    a = load_drafter(lm, "auto")
    assert a.methods == ["off", "lookup"]  # nothing trained yet
    assert a.medusa is None and a.kangaroo is None and not a.wants_hidden
    assert a.path == auto_figures_path(lm)
    assert load_drafter(lm, "auto", remember=False).path is None
    with pytest.raises(AcceleratorError, match="train --method medusa"):
        load_drafter(lm, "medusa+lookup")
    with pytest.raises(AcceleratorError, match="train --method kangaroo"):
        load_drafter(lm, "kangaroo+lookup")


# -- the simple rule Auto is measured against ----------------------------------------------


@pytest.mark.parametrize("fastest", ["kangaroo", "medusa+lookup", "off"])
def test_the_simple_rule_copies_or_takes_calibrations_fastest_and_counts_nothing(
        tiny, fastest):
    speedups = {"off": 1.0, "lookup": 1.1, "medusa+lookup": 1.2, "kangaroo": 1.15}
    speedups[fastest] = 1.4
    a = make_auto(tiny, speedups, cls=Counting, adaptive=False)
    params = SamplingParams(max_new_tokens=40)
    for prompt in (repetitive_prompt(64), [9, 8, 7, 6]):
        assert run(tiny, prompt, params, a)[1] == run(tiny, prompt, params)[1]
    assert set(a.all_steps) - {COPY} == {fastest}  # never explores, never switches
    # no counting for the arms that did not run
    assert all(arm == fastest for _kind, arm, _root, _draft in a._reply.pending)
    assert not a._reply.roots
