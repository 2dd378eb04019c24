"""A grammar over a tiny vocabulary, written to the interface engine.decode.grammar's matchers
offer (`start(lm)` -> allowed / consume / rollback / advance / forced): a reply repeats
`pattern`, one set of allowed tokens per position, so a position whose set has one token is
forced. The exact distribution of a reply under it can be enumerated (statistical tests)."""

from __future__ import annotations

import torch


class ToyGrammar:
    """Position i of a reply may hold the tokens pattern[i % len(pattern)]."""

    label = "the toy grammar"

    def __init__(self, pattern: list[set[int]]):
        self.pattern = pattern

    def allows(self, position: int, token: int) -> bool:
        return token in self.pattern[position % len(self.pattern)]

    def start(self, lm) -> ToyMatcher:
        return ToyMatcher(self)


class ToyMatcher:
    def __init__(self, grammar: ToyGrammar):
        self.grammar, self.position = grammar, 0

    def allowed(self, out: torch.Tensor) -> None:
        out.zero_()
        for token in self.grammar.pattern[self.position % len(self.grammar.pattern)]:
            if token < out.shape[0]:
                out[token] = 1

    def consume(self, token: int) -> bool:
        if not self.grammar.allows(self.position, token):
            return False
        self.position += 1
        return True

    def rollback(self, n: int) -> None:
        self.position -= n

    def advance(self, tokens: list[int]) -> None:
        self.position += len(tokens)  # a broken loop may take a refused token: tests see it

    def forced(self) -> list[int]:
        out, position = [], self.position
        while len(p := self.grammar.pattern[position % len(self.grammar.pattern)]) == 1:
            out.append(next(iter(p)))
            position += 1
            if len(out) >= 8:
                break
        return out


# Over tokens 3..11: two free positions, then a forced run of three.
PATTERN = [{3, 4, 5, 6, 7}, {5, 6, 7, 8, 9, 10, 11}, {9}, {4}, {10}]
