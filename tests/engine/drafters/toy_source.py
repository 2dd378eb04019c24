"""A toy drafting source, written the way a new one is added: this module and one registry
row. It knows the reply it expects (`script`) and offers its next tokens, each with the
chance `sure` of being kept."""

from __future__ import annotations

from engine.decode.drafter import Draft, Drafter, DraftOffer, Session


class ToyDrafter(Drafter):
    name = "toy"
    drafts = True

    def __init__(self, script: list[int], sure: float, length: int = 4) -> None:
        self.script, self.sure, self.length = script, sure, length

    def start(self, state, prefill) -> Session:
        return ToySession(self, state.prompt_len)


class ToySession(Session):
    def __init__(self, toy: ToyDrafter, prompt_len: int) -> None:
        self.toy, self.prompt_len = toy, prompt_len

    def next_tokens(self, state) -> list[int]:
        done = len(state.ids) - self.prompt_len  # reply tokens chosen so far
        return self.toy.script[done:done + min(self.toy.length, state.room)]

    def propose(self, state) -> Draft:
        return Draft.chain(state.ids[-1], self.next_tokens(state))

    def offer(self, state) -> DraftOffer | None:
        tokens, root = self.next_tokens(state), state.ids[-1]
        if not tokens:
            return None
        return DraftOffer("toy", lambda k: Draft.chain(root, tokens[:k]),
                          chances=tuple(self.toy.sure ** i for i in range(1, len(tokens) + 1)))
