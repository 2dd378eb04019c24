"""Kangaroo: the model drafts for itself from an early exit (Liu et al., 2024).

Draft model = the model's first `l` decoder layers (frozen, shared) + an adapter (one
decoder layer of the model's own class, initialised from a copy of one of its layers, and the
final norm) + the model's frozen LM head. Drafting stops once the draft's top-1 probability
is <= eta or after gamma tokens.
Verification runs only layers l..L on the layer-l states saved while drafting, so the shallow
layers never run twice for a token; the verifier's own next token starts the next round.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum

import torch
from transformers import DynamicCache

from engine.decode import kv_cache, split
from engine.decode.drafter import Draft, Drafter, DraftOffer, Session
from engine.decode.sampling import logits_to_probs, sample_from
from engine.drafters.accelerators import check_format
from engine.drafters.kangaroo_adapter import Adapter, adapt, draft_head
from engine.drafters.payoff import not_paying_notice, round_ratio
from engine.errors import AcceleratorError
from engine.weights import quant

log = logging.getLogger(__name__)

# How many rounds' worth calibration's tokens per round count for against a reply's own.
PRIOR_ROUNDS = 4.0
# Checkpoint layout of the adapter: 2 = one decoder layer of the model's class + final norm
# (1 was a hand-built attention block). Other layouts are refused at load.
FORMAT = 2


@dataclass(frozen=True)
class KangarooSettings:
    """Everything besides the weights that rebuilds a Kangaroo drafter."""

    exit_layer: int = 2  # l: the adapter reads the output of the first l decoder layers
    eta: float = 0.6  # stop drafting once the draft's top-1 probability is <= eta
    gamma: int = 6  # at most this many draft tokens per step; 0 = off (nothing paid here)
    source_layer: int = -1  # the decoder layer the adapter's layer was copied from (its kind:
    # sliding or full attention, rotary or not); negative counts from the end

    def to_json(self) -> dict:
        return {**asdict(self), "format": FORMAT}

    @classmethod
    def from_json(cls, data: dict) -> KangarooSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def check(self, num_layers: int) -> None:
        """Raise AcceleratorError for settings this model cannot run."""
        if not 1 <= self.exit_layer < num_layers:
            raise AcceleratorError(
                f"Kangaroo exit layer {self.exit_layer} is outside 1..{num_layers - 1} "
                "for this model"
            )
        if self.gamma < 0 or not 0.0 <= self.eta < 1.0:
            raise AcceleratorError(f"invalid Kangaroo settings: gamma {self.gamma}, eta {self.eta}")


class KangarooDrafter(Drafter):
    """Drafts with the early exit + adapter; verifies with the remaining layers only."""

    name = "kangaroo"
    drafts = True
    wants_hidden = True  # start() reads the prompt's layer-l states from the prefill
    verifies = True  # runs only the layers above the early exit over its drafts

    def __init__(self, lm, adapter: Adapter, settings: KangarooSettings,
                 vocab: torch.Tensor | None = None, metrics: dict | None = None,
                 round_cost: float | None = None):
        """metrics: calibration's (its "mean_accepted" tokens per round); round_cost: plain
        steps a round costs where known, else timed here at first use (round_cost())."""
        split.check_supported(lm.model)
        settings.check(split.num_layers(lm.model))
        head = lm.model.get_output_embeddings()
        vocab_size = getattr(head, "out_features", None) or head.weight.shape[0]
        if vocab is not None and not (vocab.numel() > 0 and 0 <= int(vocab.min())
                                      and int(vocab.max()) < vocab_size):
            raise AcceleratorError("the Kangaroo draft vocabulary does not fit this model's")
        self.lm = lm
        self.settings = settings
        # A copy: the caller's adapter (e.g. one being trained in float32) stays as it is.
        self.adapter = copy.deepcopy(adapter).to(lm.device, lm.dtype).eval().requires_grad_(False)
        self.vocab = None if vocab is None else vocab.to(lm.device, torch.long)
        # (Vd, H) LM-head rows the drafts are scored on; None: the model's low-bit head
        # itself (its dense rows would be a full-precision copy of the whole head).
        self.head = (None if self.vocab is None and isinstance(head, quant.LowBitLinear)
                     else draft_head(lm.model, self.vocab).to(lm.dtype))
        self.vocab_size = vocab_size
        self.metrics = metrics or {}
        # tokens a round adds (its own included), as calibration measured on held-out
        # prompts; None: never measured, so it does not draft in a composite
        tokens = self.metrics.get("mean_accepted")
        self.tokens_per_round = float(tokens) if isinstance(tokens, (int, float)) else None
        self._round_cost: dict[str, float] = {}  # plain steps of a round, by step kind
        self._fixed_round_cost = round_cost
        # gamma 0: calibration found no setting faster than plain decoding, so decode plainly.
        self.off = settings.gamma == 0
        self.wants_hidden = not self.off

    @classmethod
    def from_checkpoint(cls, lm, ckpt) -> KangarooDrafter:
        """Rebuild the drafter stored in `ckpt` (engine.drafters.accelerators.Checkpoint) for `lm`;
        its rounds are timed here, and where they would not pay it decodes plainly and
        says so."""
        split.check_supported(lm.model)
        stored = ckpt.info.get("settings", {})
        check_format(stored.get("format", 1), FORMAT, "kangaroo", ckpt.folder, "adapter")
        settings = KangarooSettings.from_json(stored)
        state = {k.removeprefix("adapter."): v for k, v in ckpt.tensors.items()
                 if k.startswith("adapter.")}
        try:
            adapter = Adapter(lm.model, settings.source_layer)
            adapter.load_state_dict(state, strict=True)
        except (RuntimeError, IndexError) as exc:
            raise AcceleratorError(
                f"the Kangaroo accelerator in {ckpt.folder} does not match this model's layout; "
                "run: python launcher.py train --method kangaroo"
            ) from exc
        drafter = cls(lm, adapter, settings, ckpt.tensors.get("draft_vocab"), ckpt.metrics)
        if drafter.off:  # calibration found nothing faster than plain decoding
            measured = drafter.metrics.get("speedup")
            drafter.notice = ("Kangaroo" if not isinstance(measured, (int, float)) else
                              f"Kangaroo was measured slower than plain decoding on this "
                              f"machine ({measured:.2f}x): acceleration Off is faster")
        elif not drafter.pays_off:
            drafter.off, drafter.wants_hidden = True, False
            drafter.notice = not_paying_notice("Kangaroo", lm, drafter.speedup or 0.0)
        if drafter.notice:
            log.warning("%s", drafter.notice)
        return drafter

    def round_cost(self) -> float:
        """Plain steps one round costs here (its drafts, the layers above the exit over
        them), drafting as many tokens as a round keeps on average, timed in turn with the
        plain step of the step kind running now (once per kind)."""
        if self._fixed_round_cost is not None:
            return self._fixed_round_cost
        kind = self.lm.target.name
        if kind not in self._round_cost:
            drafted = max(1, min(self.settings.gamma, math.ceil(self.tokens_per_round or 1.0)))
            # eta 0: the timed rounds draft exactly that many.
            self._round_cost[kind] = round_ratio(self.lm, self.with_schedule(0.0, drafted))
        return self._round_cost[kind]

    @property
    def speedup(self) -> float | None:
        """Estimated speed over plain decoding here: calibration's tokens per round over a
        round's cost timed here (None: never measured, or no round to time)."""
        if self.tokens_per_round is None or self.settings.gamma == 0:
            return None
        return self.tokens_per_round / self.round_cost()

    def with_schedule(self, eta: float, gamma: int) -> KangarooDrafter:
        """A drafter sharing these weights with another eta and gamma (calibration)."""
        other = copy.copy(self)
        other.settings = replace(self.settings, eta=eta, gamma=gamma)
        other.settings.check(split.num_layers(self.lm.model))
        other.off = gamma == 0
        other.wants_hidden = not other.off
        other._round_cost = {}
        return other

    @property
    def retimed_speedup(self) -> float | None:
        """The estimate made here at load (see speedup)."""
        return self.speedup

    @property
    def pays_off(self) -> bool:
        """Whether its rounds are estimated faster than plain decoding here (never measured:
        it drafts alone as asked, and nothing in a composite)."""
        if self.settings.gamma == 0:
            return False
        return self.tokens_per_round is None or (self.speedup or 0.0) > 1.0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors: adapter weights and the reduced vocabulary, if any."""
        out = {f"adapter.{k}": v for k, v in self.adapter.state_dict().items()}
        if self.vocab is not None:
            out["draft_vocab"] = self.vocab.cpu()
        return out

    def extra_bytes(self) -> int:
        """Memory the drafter adds to the model: adapter weights and any copied head rows."""
        total = sum(p.numel() * p.element_size() for p in self.adapter.parameters())
        if self.vocab is not None:
            total += self.head.numel() * self.head.element_size()
        return total

    def guesses(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The adapter's drafts over (n, H) adapter states: (n, Vd) float32 logits, the (n,)
        top-1 token ids and their (n,) probabilities. Drafting goes on after a guess while
        its probability is above eta (one rule for drafting and calibration)."""
        # (n, H) x (Vd, H)^T: the matmul kernel; a bf16 matrix-vector product is far slower.
        logits = split.logits(self.lm.model, states, self.head).float()
        top, idx = torch.softmax(logits, -1).max(-1)
        return logits, idx if self.vocab is None else self.vocab[idx], top

    def start(self, state, prefill) -> Session:
        """A reply's session; the adapter reads the whole prompt's layer-l states at its
        first round."""
        if self.off:
            return Session()
        return KangarooSession(self, split.exit_states(prefill, self.settings.exit_layer))


class Phase(Enum):
    """Where a Kangaroo session is within a step. Within a round the shallow layers (and
    the adapter's cache) hold the drafted tokens while the deep layers do not yet: each
    phase says which states exist, and the session's methods move it on in this order
    only: READY -propose-> DRAFTED -score-> SCORED -commit-> READY (observe: READY)."""

    READY = "ready"  # between rounds: `unread` holds committed states the adapter has not read
    DRAFTED = "drafted"  # `drafted`: layer-l states of the root and d1..d(k-1)
    SCORED = "scored"  # `scored`: layer-l states of every verified node, the deep layers run


class KangarooSession(Session):
    """One reply drafting with the early exit + adapter; it verifies its own drafts with
    the layers above the exit."""

    wants_hidden = True

    def __init__(self, drafter: KangarooDrafter, unread: torch.Tensor) -> None:
        self.drafter = drafter
        self.settings = drafter.settings
        self.cache = DynamicCache()  # the adapter's own KV cache (one layer)
        self.phase = Phase.READY
        # (1, m, H) layer-l states of committed tokens the adapter has not read yet
        self.unread = unread
        self.drafted: torch.Tensor | None = None  # (1, k, H) layer-l states of root, d1..d(k-1)
        self.scored: torch.Tensor | None = None  # (1, k + 1, H) layer-l states of verified nodes
        self.external = False  # the round's states were not read by the adapter (no room)
        self.kept = 0.0  # drafted tokens this reply's rounds kept
        self.rounds = 0  # rounds this reply drafted

    def _move(self, step: str, start: Phase, end: Phase) -> None:
        """Enter `end` from `start`; anything else is a caller's bug, said at once instead
        of caches that silently disagree."""
        if self.phase is not start:
            raise RuntimeError(f"Kangaroo's {step} needs a {start.value} session; "
                               f"this one is {self.phase.value}")
        self.phase = end

    def expected_tokens(self) -> float:
        """Drafted tokens a round is expected to keep: calibration's figure, corrected by
        this reply's rounds (calibration counting for PRIOR_ROUNDS rounds)."""
        prior = (self.drafter.tokens_per_round or 1.0) - 1.0
        return (PRIOR_ROUNDS * prior + self.kept) / (PRIOR_ROUNDS + self.rounds)

    def offer(self, state) -> DraftOffer | None:
        """An adapter round at its expected kept tokens and its cost timed here, verified by
        this session alone (nothing where it was never measured)."""
        gamma = min(self.settings.gamma, state.room)
        if gamma == 0 or self.drafter.tokens_per_round is None:
            return None
        # a round drafts all or nothing: only the sum counts, at most every token kept
        per_token = min(1.0, self.expected_tokens() / gamma)
        return DraftOffer("kangaroo", lambda _k: self.propose(state), (per_token,) * gamma,
                          round_cost=self.drafter.round_cost(), joins=False)

    def propose(self, state) -> Draft:
        """Run the pending token through the shallow layers, then draft until unsure."""
        self._move("propose", Phase.READY, Phase.DRAFTED)
        s = self.settings
        gamma = min(s.gamma, state.room)
        start = state.cached
        h = self._shallow(state, state.ids[-1], start)  # (1, 1, H) root state
        self.external = gamma == 0
        if self.external:  # no room for a draft token: the round verifies the root alone
            self.drafted = h
            return Draft.chain(state.ids[-1], [])
        x, x_start = torch.cat([self.unread, h], dim=1), start - self.unread.shape[1]
        states, tokens, qs = [h], [], []
        while True:
            # (H,) adapter state of the last position
            out = adapt(self.drafter.lm.model, self.drafter.adapter, x, x_start, self.cache)[0, -1]
            token, q, confident = self._choose(out, state)
            tokens.append(token)
            qs.append(q)
            if len(tokens) == gamma or not confident:
                break
            x_start = start + len(tokens)
            x = self._shallow(state, token, x_start)
            states.append(x)
        self.unread = self.unread[:, :0]
        self.drafted = torch.cat(states, dim=1)
        q_rows = torch.stack(qs) if qs[0] is not None else None
        return Draft.chain(state.ids[-1], tokens, q_rows)

    def queue_unread(self, exits: torch.Tensor) -> None:
        """Queue the (1, m, H) layer-l states of tokens just committed by a round the adapter
        did not draft (another source's whole-model forward): the adapter reads them at its
        next round, so no layer runs twice for a token."""
        self.unread = torch.cat([self.unread, exits], dim=1)

    def observe(self, state, layers, path: list[int], offered: list[int]) -> None:
        """After another source's whole-model round: the adapter reads the kept tokens'
        layer-l states at its next round."""
        if self.phase is not Phase.READY:
            raise RuntimeError(f"Kangaroo's observe needs a ready session; this one is "
                               f"{self.phase.value}")
        if layers is None:
            return
        self.queue_unread(layers[self.settings.exit_layer][:, [0, *path]])
        state.target.rollback(state.cache, 0)  # trims sliding-window layers

    def score(self, state, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers l..L over the saved layer-l states (+ the last draft token's, computed now
        unless the round already ran it): logits and the final (normed) hidden states,
        which Medusa's heads read when a composite mixes the two."""
        self._move("score", Phase.DRAFTED, Phase.SCORED)
        model = self.drafter.lm.model
        start, k = state.cached, draft.size - 1
        self.scored = self.drafted
        if self.drafted.shape[1] == k:
            last = self._shallow(state, draft.tokens[-1], start + k)
            self.scored = torch.cat([self.drafted, last], dim=1)  # (1, k + 1, H)
        target = state.target
        deep = range(self.settings.exit_layer, split.num_layers(model))
        h = target.norm(target.run_layers(self.scored, deep, state.cache, start))
        return target.logits(h)[0], h[0]

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        """Keep the root and accepted drafts in every layer and in the adapter's cache."""
        self._move("commit", Phase.SCORED, Phase.READY)
        k, a = draft.size - 1, len(path)
        if k:
            self.kept, self.rounds = self.kept + a, self.rounds + 1
        state.target.rollback(state.cache, k - a)  # every layer held start + k + 1
        if self.external:  # the adapter has read none of this round's states
            self.queue_unread(self.scored[:, :a + 1])
        elif a < k:
            # The adapter read the root and d1..d(k-1): keep the root and d1..da.
            kv_cache.rollback(self.cache, k - a - 1)
        else:
            self.unread = self.scored[:, k:]  # dk's state, read at the next propose
        self.drafted = self.scored = None

    # -- pieces ---------------------------------------------------------------------------

    def _shallow(self, state, token: int, position: int) -> torch.Tensor:
        """(1, 1, H): `token` at `position` through the first l layers (cached)."""
        h = state.target.embed([token], position)
        return state.target.run_layers(h, range(self.settings.exit_layer), state.cache,
                                       position)

    def _choose(self, out: torch.Tensor, state) -> tuple[int, torch.Tensor | None, bool]:
        """Draft token, its q row (V,) for speculative sampling (else None), and whether
        the draft is sure enough to go on."""
        d = self.drafter
        logits, top1, top = d.guesses(out[None])
        sure = bool(top[0] > d.settings.eta)  # sure enough to draft on after
        params = state.params
        if params.acceptance_mode != "lossless":
            return int(top1[0]), None, sure
        q_small = logits_to_probs(logits[0], params)
        idx = sample_from(q_small, state.generator)
        if d.vocab is None:
            return idx, q_small, sure
        q = torch.zeros(d.vocab_size, device=q_small.device).index_copy_(0, d.vocab, q_small)
        return int(d.vocab[idx]), q, sure
