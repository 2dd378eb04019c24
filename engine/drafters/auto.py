"""Auto: every decode step drafts the way that pays most at that point of the reply.

Which drafter is fastest depends on the prompt as much as on the machine: a summary copies
its source (lookup wins), an answer in fresh words does not (Medusa's tree or Kangaroo's
adapter wins, or plain decoding where neither pays). Auto therefore chooses per step, among
the ways of drafting that share one KV cache:

- copy: the latest tokens match an earlier 3-gram, so a copy is in progress: the lookup
  continuation alone (every method drafts the same here).
- otherwise an *arm*: plain decoding ("off"), the short lookup continuation ("lookup", only
  when the latest tokens match an earlier 1- or 2-gram), Medusa's tree with that
  continuation beside it ("medusa+lookup"), or a Kangaroo adapter round ("kangaroo").

A step takes the arm with the best tokens per second over all replies on its kind of step
(no lookup match, or a match of 1 or 2 tokens), unless the current reply's figures put
another arm ahead by a margin. An arm's figures are running means of the tokens a round of
it yields and of the seconds it takes. Seconds come from the rounds each arm runs (an arm unused for
`explore_every` steps of a kind runs once more), split into the arm's cost and the pace the
machine runs at just now, which every arm shares (see Pace). Tokens vary with the text, so
they are also counted for arms that did not run, from what the reply went on to say: the
lookup continuation every step, Medusa's tree every `shadow_every`-th step and Kangaroo's
adapter every `adapter_every`-th (it reads the tokens it lags behind then, as its next round
would, and its guesses over them are walked along the reply). Each reply starts from the
means over all replies and follows its own text from there. Estimates start from
calibration (the speedup stored with each trained accelerator x a plain step timed when
Auto is built) and persist per model, device and dtype. Off is an arm, so Auto never
settles on slower decoding.

Rounds that do not use the adapter run the whole model once with every layer's states kept:
Medusa's heads read the final state, and the Kangaroo adapter reads the layer-l states of
the kept tokens at its next round, so no layer runs twice for a token. Verification is the
shared loop's, so greedy replies stay exactly plain greedy decoding and sampling stays
lossless (the arm a step takes depends only on the past).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import kv_cache
from engine.drafters.auto_figures import (
    COPY,
    KANGAROO,
    MEDUSA,
    NO_MATCH,
    AutoPolicy,
    Figures,
    Pace,
    arms_for,
    match_kind,
    save_figures,
)
from engine.drafters.base import Draft, Drafter, forward_layers
from engine.drafters.hybrid import TreeWithChain, chain_accepted
from engine.drafters.kangaroo import KangarooDrafter
from engine.drafters.lookup import LookupParams, LookupSource
from engine.drafters.medusa import MedusaDrafter
from engine.drafters.registry import ACCEL_LABELS


def accepted_length(draft: Draft, ids: list[int], root: int) -> int | None:
    """Draft tokens greedy verification keeps when `ids[root]` is the draft's root and the
    reply went on as `ids` says (the deepest agreeing branch); None while too little of the
    reply is known to tell."""

    def walk(node: int, pos: int) -> int | None:
        best = 0
        for child in draft.children[node]:
            if pos + 1 >= len(ids):
                return None
            if draft.tokens[child] == ids[pos + 1]:
                deeper = walk(child, pos + 1)
                if deeper is None:
                    return None
                best = max(best, 1 + deeper)
        return best

    return walk(0, root)


@dataclass
class _Round:
    kind: str  # MATCH, NO_MATCH or COPY
    arm: str
    began: float  # perf_counter() at propose
    chain: int  # lookup tokens in the draft (its last nodes)
    exits: torch.Tensor | None = None  # (1, n, H) layer-l states of a whole-model round
    aside: float = 0.0  # seconds spent counting for other arms (not the round's cost)


@dataclass
class _Reply:
    """Counting in progress for one reply."""

    pending: list[tuple[str, str, int, Draft]] = field(default_factory=list)  # kind, arm,
    # root position, proposal: counted once the reply shows how far it would have held
    roots: dict[int, str] = field(default_factory=dict)  # step roots the adapter has not
    # been counted at -> their kind
    guesses: dict[int, tuple[int, bool]] = field(default_factory=dict)  # position -> the
    # adapter's guess after it and whether it was sure, while a root still needs it
    shadows: int = 0  # steps since Medusa's tree was last proposed for counting


class AutoDrafter(Drafter):
    """Chooses how each step drafts: copy, off, lookup, Medusa+lookup or Kangaroo."""

    name = "auto"

    def __init__(self, figures: Figures, medusa: MedusaDrafter | None = None,
                 kangaroo: KangarooDrafter | None = None, path: Path | None = None,
                 policy: AutoPolicy | None = None, lookup: LookupParams | None = None):
        self.source = LookupSource(lookup or LookupParams())
        self.arms = arms_for(medusa is not None, kangaroo is not None, self.source.params)
        if any(set(figures.get(k, {})) != set(a) for k, a in self.arms.items()):
            raise ValueError("Auto needs a figure for every arm of every kind of step")
        self.figures = figures
        self.medusa, self.kangaroo = medusa, kangaroo
        self.merge = TreeWithChain(medusa.tree) if medusa is not None else None
        self.path = path  # where measured figures persist; None = this process only
        self.policy = policy or AutoPolicy()
        # the simple rule's arm: the fastest by the figures Auto starts from (calibration's)
        self.fixed = max(self.arms[NO_MATCH], key=lambda a: figures[NO_MATCH][a].long_tok_s)
        self.pace = Pace()
        self.wants_hidden = medusa is not None or kangaroo is not None
        self.steps = Counter()  # steps of each kind so far
        self.last_used: dict[tuple[str, str], int] = {}  # (kind, arm) -> step it last ran
        self.used: Counter = Counter()  # steps per arm in the current reply (copy included)
        self.last_reply: Counter = Counter()  # the same for the last finished reply
        self.last_speedup: float | None = None  # last reply's decoding speed / Off's
        self._round: _Round | None = None
        self._reply = _Reply()

    @property
    def methods(self) -> list[str]:
        """Every arm Auto can choose, plain decoding first."""
        return list(dict.fromkeys(["off", "lookup", *self.arms[NO_MATCH]]))

    @property
    def current(self) -> str:
        """The arm that ran most steps of the last reply (before any: the best estimate)."""
        arms = Counter({a: n for a, n in self.last_reply.items() if a != COPY})
        if arms:
            return arms.most_common(1)[0][0]
        return self._best(NO_MATCH, self.arms[NO_MATCH])

    # -- the decode loop's hooks ---------------------------------------------------------

    def start(self, state, prefill) -> None:
        self._round = None  # the last reply's last round is not timed: nothing followed it
        self.source.reset()
        self.used = Counter()
        self._reply = _Reply()
        for arms in self.figures.values():
            for fig in arms.values():
                fig.new_reply()
        if self.kangaroo is not None:
            self.kangaroo.start(state, prefill)

    def propose(self, state) -> Draft:
        self._time_last_round()
        self._count_pending(state.ids)
        began = time.perf_counter()
        chain, n = self.source.match(state.ids, state.room)
        root = state.ids[-1]
        if chain and self.source.copying(n):
            kind, arm = COPY, COPY
        else:
            kind = match_kind(n) if chain else NO_MATCH
            arm = self._choose(kind)
        r = self._round = _Round(kind, arm, began, 0 if arm in ("off", KANGAROO) else len(chain))
        counting = self.policy.adaptive
        if counting and chain and kind != COPY:  # counted whichever arm runs
            self._reply.pending.append((kind, "lookup", state.cached, Draft.chain(root, chain)))
        if arm == KANGAROO:
            if counting:
                self._count_adapter(state, round_follows=True)
            return self.kangaroo.propose(state)
        if kind == COPY:
            return Draft.chain(root, chain)
        if counting and self.kangaroo is not None \
                and len(self._reply.roots) >= self.policy.adapter_every:
            self._count_adapter(state, round_follows=False)
        if counting:
            self._reply.roots[state.cached] = kind
        merged = self._tree(state, kind, chain, arm == MEDUSA)
        return merged if arm == MEDUSA else Draft.chain(root, chain if r.chain else [])

    def score(self, state, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._round.arm == KANGAROO:
            return self.kangaroo.score(state, draft)
        logits, hidden = forward_layers(state, draft, self.wants_hidden)
        if hidden is None:
            return logits, None
        if self.kangaroo is not None:
            self._round.exits = hidden[self.kangaroo.settings.exit_layer]
        return logits, hidden[-1][0]

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        r = self._round
        if r.arm == KANGAROO:
            self.kangaroo.commit(state, draft, path)
        else:
            kv_cache.keep_path(state.cache, state.cached, [0, *path])
            if r.exits is not None:  # the adapter reads the kept tokens at its next round
                self.kangaroo.absorb(r.exits[:, [0, *path]])
                r.exits = None
                kv_cache.rollback(state.cache, 0)  # trims sliding-window layers
        self.source.update(r.chain, chain_accepted(draft, r.chain, path))
        self.used[r.arm] += 1
        if r.kind != COPY and r.arm in ("off", KANGAROO):  # the others: counted from the reply
            self.figures[r.kind][r.arm].add_tokens(1 + len(path), self.policy)

    def _time_last_round(self) -> None:
        """A round's seconds run from its propose to the next one: the decode loop's own
        work per step (acceptance, detokenizing, streaming) is part of what a step costs."""
        r, self._round = self._round, None
        if r is not None and r.kind != COPY:
            seconds = time.perf_counter() - r.began - r.aside
            self.pace.time(self.figures[r.kind][r.arm], seconds, self.policy)

    def finish(self, stats) -> None:
        """Keep the reply's mix and speed for the readout; save the figures."""
        self.last_reply = self.used
        decode_s = stats.elapsed_s - stats.ttft_s
        off = self.figures[NO_MATCH]["off"].tok_s / self.pace.factor  # at today's pace
        self.last_speedup = ((stats.tokens - 1) / decode_s / off
                             if stats.tokens > 1 and decode_s > 0 else None)
        self._save()

    # -- counting tokens for arms that did not run ---------------------------------------

    def _tree(self, state, kind: str, chain: list[int], needed: bool) -> Draft | None:
        """Medusa's tree with the lookup chain beside it: when the round uses it, and every
        shadow_every-th other step to count what it would have kept."""
        if self.medusa is None:
            return None
        reply = self._reply
        reply.shadows += 1
        if not needed and (reply.shadows < self.policy.shadow_every
                           or not self.policy.adaptive):
            return None
        began = time.perf_counter()
        reply.shadows = 0
        merged = self.merge(self.medusa.propose(state), chain)
        reply.pending.append((kind, MEDUSA, state.cached, merged))
        if not needed:
            self._round.aside += time.perf_counter() - began
        return merged

    def _count_pending(self, ids: list[int]) -> None:
        """Count the proposals whose outcome the reply now shows."""
        waiting = []
        for kind, arm, root, draft in self._reply.pending:
            kept = accepted_length(draft, ids, root)
            if kept is None:
                waiting.append((kind, arm, root, draft))
            else:
                self.figures[kind][arm].add_tokens(1 + kept, self.policy)
        self._reply.pending = waiting

    def _count_adapter(self, state, round_follows: bool) -> None:
        """Count, for the steps since it last did, the tokens an adapter round would have
        kept there: the adapter reads the tokens it lags behind by now (as its next round
        would) and its guesses over them are walked along the reply. `round_follows`: an
        adapter round runs next, reading states this count cannot see, so steps still
        unresolved are dropped."""
        began = time.perf_counter()
        k, reply = self.kangaroo, self._reply
        caught = k.catch_up(state)
        if caught is not None and reply.roots:
            first, read = caught  # read[i] predicts the token after position first + i
            lo = max(first, min(reply.roots))
            _logits, guess, top = k.guesses(read[lo - first:])
            pairs = enumerate(zip(guess.tolist(), k.sure(top).tolist(), strict=True))
            reply.guesses.update({lo + j: (g, u) for j, (g, u) in pairs})
        waiting = {}
        for root, kind in reply.roots.items():
            kept = adapter_kept(reply.guesses, state.ids, root, k.settings.gamma)
            if kept is not None:
                self.figures[kind][KANGAROO].add_tokens(1 + kept, self.policy)
            elif not round_follows:
                waiting[root] = kind
        reply.roots = waiting
        reply.guesses = {p: g for p, g in reply.guesses.items() if waiting and p >= min(waiting)}
        self._round.aside += time.perf_counter() - began

    # -- choosing -------------------------------------------------------------------------

    def _choose(self, kind: str) -> str:
        """The best arm for this kind of step, unless one is due to be timed again."""
        if not self.policy.adaptive:
            return self.fixed if self.fixed in self.arms[kind] else "off"
        step = self.steps[kind]
        self.steps[kind] += 1
        arms = self.arms[kind]
        last = {a: self.last_used.get((kind, a), -10**9) for a in arms}
        p, figs = self.policy, self.figures[kind]
        due = [a for a in arms if step - last[a] >= (
            p.explore_every if figs[a].rounds >= p.first_rounds else 8)]
        if due:  # the longest untimed first (ties: the best estimate)
            oldest = min(last[a] for a in due)
            arm = self._best(kind, [a for a in due if last[a] == oldest])
        else:
            arm = self._best(kind, arms)
        self.last_used[(kind, arm)] = step
        return arm

    def _best(self, kind: str, arms) -> str:
        """The arm that pays most over all replies, unless this reply's figures put another
        ahead by more than the switch margin: a reply's running means are noisy, and always
        taking the best noisy estimate favours the arm that is over-estimated just now."""
        figs = self.figures[kind]
        home = max(arms, key=lambda a: figs[a].long_tok_s)
        best = max(arms, key=lambda a: figs[a].tok_s)
        return best if figs[best].tok_s > (1 + self.policy.switch_margin) * figs[home].tok_s \
            else home

    def reason(self) -> str:
        """One line for the readout: how the last reply drafted and what it gained."""
        total = sum(self.last_reply.values())
        if not total:
            arm = self.current
            off = self.figures[NO_MATCH]["off"].tok_s
            gain = self.figures[NO_MATCH][arm].tok_s / off
            return (f"Auto starts with {_label(arm)}: {gain:.2f}x Off estimated from "
                    "calibration; each step then takes what measures fastest here")
        mix = ", ".join(f"{_label(a)} {100 * n / total:.0f}%"
                        for a, n in self.last_reply.most_common())
        speed = (f"; {self.last_speedup:.2f}x Off" if self.last_speedup is not None else "")
        return f"Auto drafted {mix} of the steps{speed}"

    def _save(self) -> None:
        if self.path is not None:
            save_figures(self.path, self.figures)


def adapter_kept(guesses: dict[int, tuple[int, bool]], ids: list[int], root: int,
                  gamma: int) -> int | None:
    """Tokens an adapter round rooted at position `root` would have kept: its drafts follow
    the reply while they are right (each then being the adapter's teacher-forced guess),
    stopping after gamma or after an unsure one. guesses: position -> (the adapter's top
    token after it, whether its probability beat eta). None while some guess is missing."""
    kept = 0
    while kept < gamma:
        pos = root + kept
        if pos not in guesses:
            return None
        token, sure = guesses[pos]
        if token != ids[pos + 1]:
            return kept
        kept += 1
        if not sure:
            return kept
    return kept


def _label(arm: str) -> str:
    return "copying" if arm == COPY else ACCEL_LABELS.get(arm, arm)
