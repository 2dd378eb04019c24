"""A test view of any drafter: the sessions of its replies, the step kinds of every reply,
and a hook after every commit (the drafters themselves stay as they ship)."""

from __future__ import annotations

from collections import Counter

from engine.decode.drafter import Drafter, Session


class Spy(Drafter):
    """`inner` as the decode loop sees it, recording its sessions and step kinds."""

    def __init__(self, inner: Drafter, after_commit=None) -> None:
        self.inner = inner
        self.after_commit = after_commit  # (state, draft, path, session) after each commit
        self.name, self.drafts = inner.name, inner.drafts
        self.wants_hidden, self.verifies = inner.wants_hidden, inner.verifies
        self.sessions: list[Session] = []  # every reply's inner session, oldest first
        self.steps: Counter = Counter()  # step kinds over every reply (composites)

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def start(self, state, prefill) -> Session:
        session = self.inner.start(state, prefill)
        self.sessions.append(session)
        return _SpySession(self, session)

    def used(self) -> str:
        return self.inner.used()

    def reason(self, stats=None) -> str:
        return self.inner.reason(stats)

    @property
    def pays_off(self) -> bool:
        return self.inner.pays_off


class _SpySession(Session):
    def __init__(self, spy: Spy, inner: Session) -> None:
        self.spy, self.inner = spy, inner

    def propose(self, state):
        return self.inner.propose(state)

    def offer(self, state):
        return self.inner.offer(state)

    def score(self, state, draft):
        return self.inner.score(state, draft)

    def commit(self, state, draft, path):
        self.inner.commit(state, draft, path)
        if self.spy.after_commit is not None:
            self.spy.after_commit(state, draft, path, self.inner)

    def observe(self, state, layers, path, offered):
        self.inner.observe(state, layers, path, offered)

    def finish(self, stats):
        self.inner.finish(stats)
        if stats is not None:
            self.spy.steps.update(stats.step_kinds)


def sessions_of(session: Session) -> list[Session]:
    """`session` and, for a composite's, its sources' sessions (under any spies)."""
    while isinstance(session, _SpySession):
        session = session.inner
    return [session, *getattr(session, "sessions", [])]
