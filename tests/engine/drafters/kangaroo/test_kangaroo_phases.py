"""A Kangaroo session's phases: the shallow and deep layers' caches agree only when its
calls come in order, so a call out of order is refused at once."""

from __future__ import annotations

import pytest
import torch

from engine.drafters import payoff
from engine.drafters.kangaroo import Phase
from tests.conftest import make_tiny_model
from tests.engine.drafters.kangaroo.test_kangaroo import drafter


def test_a_session_moves_through_its_phases_in_order_only(bundled_tokenizer):
    """READY -propose-> DRAFTED -score-> SCORED -commit-> READY: a call out of that order
    is refused at once (the shallow and deep layers' caches would silently disagree)."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    state, session = payoff.prefilled(lm, drafter(lm, exit_layer=2, gamma=3))
    assert session.phase is Phase.READY
    with pytest.raises(RuntimeError, match="score needs a drafted session; this one is ready"):
        session.score(state, None)
    with torch.inference_mode():
        draft = session.propose(state)
        assert session.phase is Phase.DRAFTED
        with pytest.raises(RuntimeError, match="propose needs a ready session"):
            session.propose(state)
        with pytest.raises(RuntimeError, match="commit needs a scored session"):
            session.commit(state, draft, [])
        session.score(state, draft)
        assert session.phase is Phase.SCORED
        with pytest.raises(RuntimeError, match="observe needs a ready session"):
            session.observe(state, None, [], [])
        session.commit(state, draft, [])
    assert session.phase is Phase.READY
    session.observe(state, None, [], [])  # another source's step: still ready
