"""The datastore the bench drafts from, leave-one-out.

A method that drafts from the datastore of the model's own outputs would look far better
than it is if the store held the very reply it is measured on. So the bench never uses the
user's store: for each measured prompt it rebuilds one store from
- the training data: the store shipped with the model's accelerators (its answers to the
  seed prompts, which the trained accelerators learnt from; none for other models), and
- the plain greedy replies to the *other* prompts of the run (computed once before it),
never that prompt's own reply. Every method that drafts from the store shares it, and the
report states the rule.
"""

from __future__ import annotations

from engine.config import SamplingParams
from engine.datastore.load import load
from engine.datastore.memory import Datastore
from engine.decode.generate import run

# The methods that draft from the datastore, and the one each is compared with (the same
# method without it); "auto-no-datastore" is Auto with the datastore left out.
WITH_STORE = {"datastore": "lookup", "medusa+datastore": "medusa+lookup",
              "auto": "auto-no-datastore"}
RULE = ("leave-one-out: the datastore for a prompt holds the training data (the store "
        "shipped with the accelerators) and the plain greedy replies to the other prompts, "
        "never that prompt's own reply")


class LeaveOneOut:
    """One datastore, refilled before each prompt without that prompt's reply."""

    def __init__(self, lm) -> None:
        from engine.drafters.datastore_source import shipped_path

        path = shipped_path(lm.fingerprint)
        base = load(path, lm.fingerprint) if path.is_file() else Datastore(lm.fingerprint)
        self.base = base.docs  # the training data's documents
        self.store = Datastore(lm.fingerprint)  # what the methods draft from
        self.replies: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> plain reply
        self._for: tuple[int, ...] | None = None  # the prompt the store was filled for

    def prepare(self, replies: dict[tuple[int, ...], list[int]]) -> None:
        """Take the plain replies of the run's prompts (see plain_replies)."""
        self.replies = replies
        self._for = None

    def hold_out(self, prompt_ids: list[int]) -> None:
        """Fill the store for `prompt_ids`: everything but its own reply."""
        key = tuple(prompt_ids)
        if key == self._for:
            return
        self.store.refill([*self.base, *(r for k, r in self.replies.items() if k != key)])
        self._for = key

    def describe(self) -> dict:
        return {"rule": RULE, "training_tokens": sum(len(d) for d in self.base),
                "replies": len(self.replies)}


def plain_replies(lm, prompt_ids: list[list[int]], params: SamplingParams
                  ) -> dict[tuple[int, ...], list[int]]:
    """Plain greedy replies to the prompts, as long as the bench's."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=params.max_new_tokens)
    return {tuple(ids): run(lm, ids, greedy)[1] for ids in prompt_ids}


def ready(methods: dict, replies: dict[tuple[int, ...], list[int]]) -> dict:
    """`methods` (a bench method table) with their leave-one-out stores given `replies`;
    returns the table."""
    for m in methods.values():
        if m.held_out is not None:
            m.held_out.prepare(replies)
    return methods


def described(methods: dict) -> dict | None:
    """The datastore's settings for the report; None when no method drafts from it."""
    held = next((m.held_out for m in methods.values() if m.held_out is not None), None)
    return None if held is None else held.describe()
