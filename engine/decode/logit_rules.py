"""What one reply does to the model's logits before each choice: OpenAI's logit_bias and
presence / frequency penalties over the reply so far, and a grammar's mask.

Drafting stays lossless under them because every row of a verified draft is shaped as plain
decoding would have shaped it had the reply reached that node: the penalties count the
reply and the draft tokens above the node (engine.decode.sampling.adjust), and the grammar's mask
is the matcher's after those tokens (a walk of the draft tree, each token consumed and
rolled back). A node the grammar refuses has probability 0 under its parent's row, so no
rule can accept it or anything below it; its own row is left as the model gave it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import SamplingParams
from engine.decode.grammar import Grammar, Matcher
from engine.decode.sampling import adjust, base_adjustment, mask_logits


class LogitRules:
    """One reply's bias, penalties and grammar position (made by `start`)."""

    def __init__(self, params: SamplingParams, vocab: int, device: torch.device,
                 matcher: Matcher | None = None):
        self.params = params
        self.vocab = vocab
        self.device = device
        self.matcher = matcher  # the grammar's position after the reply so far, or None
        self.counts = torch.zeros(vocab, device=device)  # (V,) each token's uses in the reply
        self.bias = torch.zeros(vocab, device=device)  # (V,) logit_bias
        for token, value in params.logit_bias:
            if 0 <= token < vocab:
                self.bias[token] = value
        self._allowed = torch.ones(0, vocab, dtype=torch.uint8)  # grown to the largest draft

    @classmethod
    def start(cls, lm, params: SamplingParams, grammar: Grammar | None) -> LogitRules | None:
        """The rules of a reply with `params` and `grammar`; None when nothing shapes its
        logits (then the loop runs as it always did)."""
        if grammar is None and not params.shapes_logits:
            return None
        matcher = grammar.start(lm) if grammar is not None else None
        return cls(params, int(lm.model.config.vocab_size), lm.device, matcher)

    def shape(self, logits: torch.Tensor, children: Sequence[Sequence[int]],
              tokens: Sequence[int]) -> torch.Tensor:
        """(n, V) logits of a draft's nodes -> the same shaped (float32): row i as plain
        decoding would see it after node i. children/tokens: the draft's tree (node 0 is
        the pending token, already part of the reply)."""
        p = self.params
        if p.shapes_logits:
            base = base_adjustment(self.bias, self.counts, p.presence_penalty,
                                   p.frequency_penalty)
            paths = node_paths(children, tokens) if p.presence_penalty or p.frequency_penalty \
                else [[] for _ in tokens]
            logits = adjust(logits, base, self.counts, paths, p.presence_penalty,
                            p.frequency_penalty)
        else:
            logits = logits.float()
        if self.matcher is not None:
            logits = mask_logits(logits, self._masks(children, tokens))
        return logits

    def shape_next(self, logits: torch.Tensor) -> torch.Tensor:
        """(V,) logits of the position after the reply so far, shaped."""
        return self.shape(logits[None], [[]], [-1])[0]

    def advance(self, tokens: list[int]) -> None:
        """The reply took `tokens` (in order)."""
        ids = torch.tensor(tokens, device=self.device)
        self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.device))
        if self.matcher is not None:
            self.matcher.advance(tokens)

    def forced(self) -> list[int]:
        """The tokens the grammar forces after the reply so far ([] without a grammar),
        up to the first the model cannot produce."""
        tokens = self.matcher.forced() if self.matcher is not None else []
        cut = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab), len(tokens))
        return tokens[:cut]

    def _masks(self, children: Sequence[Sequence[int]], tokens: Sequence[int]) -> torch.Tensor:
        """(n, V) bool: the tokens the grammar allows after each node (a node it refuses,
        and every node below it, allows everything: no rule can reach them)."""
        n = len(tokens)
        if self._allowed.shape[0] < n:
            self._allowed = torch.ones(n, self.vocab, dtype=torch.uint8)
        allowed = self._allowed[:n]
        allowed.fill_(1)
        m = self.matcher

        def visit(node: int) -> None:
            m.allowed(allowed[node])
            for child in children[node]:
                token = tokens[child]
                if 0 <= token < self.vocab and allowed[node, token] and m.consume(token):
                    visit(child)
                    m.rollback(1)

        visit(0)
        return allowed.to(self.device, non_blocking=True).bool()


def node_paths(children: Sequence[Sequence[int]], tokens: Sequence[int]) -> list[list[int]]:
    """Per node, the draft tokens from the root down to it (the root's own excluded, the
    node's included): what plain decoding would have added to the reply to reach it."""
    paths: list[list[int]] = [[] for _ in tokens]
    todo = [0]
    while todo:
        node = todo.pop()
        for child in children[node]:
            paths[child] = [*paths[node], tokens[child]]
            todo.append(child)
    return paths
