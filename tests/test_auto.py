"""Auto: which method it picks from calibration and live figures, its fallback to Off, the
figures it keeps per model and machine, exact greedy replies while it switches, and the
registry building it from whatever is trained."""

from __future__ import annotations

import pytest
import torch

from engine.config import SamplingParams
from engine.drafters.auto import AutoDrafter, AutoPolicy, Figure, load_figures
from engine.drafters.base import Drafter
from engine.drafters.hybrid import KangarooLookupDrafter
from engine.drafters.kangaroo import Adapter, KangarooSettings
from engine.drafters.lookup import LookupDrafter
from engine.drafters.registry import auto_figures_path, load_drafter
from engine.errors import AcceleratorError
from engine.generate import run
from engine.stats import GenerationStats
from tests.conftest import make_tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


def auto(tok_s: dict[str, float], path=None, **policy) -> AutoDrafter:
    candidates = {m: Drafter() for m in tok_s}
    return AutoDrafter(candidates, {m: Figure(v) for m, v in tok_s.items()}, path,
                       AutoPolicy(**policy))


def reply(a: AutoDrafter, tok_s: float, tokens: int = 100) -> None:
    """Tell Auto a reply of `tokens` tokens decoded at `tok_s` (after 0.1 s of prefill)."""
    a.finish(GenerationStats(tokens=tokens, ttft_s=0.1, elapsed_s=0.1 + (tokens - 1) / tok_s))


def serve(a: AutoDrafter, speeds: dict[str, float], n: int) -> list[str]:
    """n replies, each decoding at the speed its method really has here; the methods used."""
    used = []
    for _ in range(n):
        used.append(a.current)
        reply(a, speeds[a.current])
    return used


def test_close_contenders_are_measured_before_the_best_estimate_is_trusted():
    a = auto({"off": 10.0, "lookup": 11.0, "medusa+lookup": 15.0, "kangaroo+lookup": 8.0})
    speeds = {"off": 10.0, "lookup": 10.5, "medusa+lookup": 12.0, "kangaroo+lookup": 5.0}
    used = serve(a, speeds, 6)
    # The best estimate first; once it measures 12, lookup (11 >= 85% of 12) is measured
    # too; off's timed estimate (10) and Kangaroo's (8) are too far behind to try.
    assert used == ["medusa+lookup"] * 2 + ["lookup"] * 2 + ["medusa+lookup"] * 2
    assert a.figures["medusa+lookup"].tok_s == pytest.approx(12.0)
    assert a.figures["kangaroo+lookup"].replies == 0


def test_falls_back_to_off_when_nothing_beats_it():
    a = auto({"off": 10.0, "lookup": 11.0})
    used = serve(a, {"off": 10.0, "lookup": 9.0}, 8)  # lookup is slower on this machine
    assert used[0] == "lookup" and used[-3:] == ["off"] * 3
    assert a.current == "off" and a.reason().startswith("Off: no accelerator was measured")


def test_live_figures_switch_methods_when_another_pays_more():
    a = auto({"off": 10.0, "lookup": 14.0, "medusa+lookup": 20.0}, revisit_every=3)
    first = serve(a, {"off": 10.0, "lookup": 15.0, "medusa+lookup": 18.0}, 4)
    assert first == ["medusa+lookup", "medusa+lookup", "lookup", "medusa+lookup"]
    # Medusa+lookup slows down here (say another program now shares the cores).
    later = serve(a, {"off": 10.0, "lookup": 15.0, "medusa+lookup": 8.0}, 6)
    assert later.count("lookup") >= 4  # the rest: revisits of the runner-up
    assert a.figures["medusa+lookup"].tok_s < a.figures["lookup"].tok_s


def test_short_replies_are_not_measured():
    a = auto({"off": 10.0, "lookup": 12.0})
    reply(a, 100.0, tokens=4)
    assert a.figures["lookup"].replies == 0


def test_the_reason_names_the_method_and_where_its_figure_comes_from():
    a = auto({"off": 10.0, "medusa+lookup": 16.0}, explore_within=1.0)
    assert a.reason() == "Medusa+lookup: 1.60x Off, estimated from calibration"
    reply(a, 18.0)
    assert a.reason() == "Medusa+lookup: 1.80x Off, measured on this machine over 1 replies"


def test_measured_figures_persist_and_a_corrupt_file_is_ignored(tmp_path, caplog):
    path = tmp_path / "auto" / "cpu-bf16.json"
    priors = {"off": 10.0, "lookup": 11.0}
    a = AutoDrafter({m: Drafter() for m in priors}, load_figures(path, priors), path)
    reply(a, 13.0)
    again = load_figures(path, priors)
    assert again["lookup"].replies == 1 and again["lookup"].tok_s == pytest.approx(13.0)
    assert again["off"] == Figure(10.0)
    path.write_text("{not json")
    assert load_figures(path, priors) == {m: Figure(v) for m, v in priors.items()}
    assert "unreadable" in caplog.text


def test_greedy_replies_stay_exact_while_auto_switches(bundled_tokenizer):
    lm = make_tiny_model("qwen2", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    torch.manual_seed(0)
    kangaroo = KangarooLookupDrafter(lm, Adapter(lm.model), KangarooSettings(2, 0.0, 4))
    candidates = {"off": Drafter(), "lookup": LookupDrafter(), "kangaroo+lookup": kangaroo}
    # Estimates far above any real speed: each method is measured once, best estimate first.
    a = AutoDrafter(candidates, {"off": Figure(1e6), "lookup": Figure(2e6),
                                 "kangaroo+lookup": Figure(3e6)},
                    policy=AutoPolicy(explore_within=0.5, min_replies=1, min_tokens=4))
    params = SamplingParams(max_new_tokens=24)
    used = []
    for prompt in ([5, 6, 7, 5, 6], [9, 8, 7, 6], [3, 4, 3, 4, 3], [11, 12, 13]):
        used.append(a.current)
        assert run(lm, prompt, params, a)[1] == run(lm, prompt, params)[1]
    assert set(used) == set(candidates)  # every method ran, prefill included
    assert sum(f.replies for f in a.figures.values()) == 4


def test_registry_builds_auto_from_what_is_trained(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    a = load_drafter(lm, "auto")
    assert set(a.candidates) == {"off", "lookup"}  # nothing trained yet
    assert a.path == auto_figures_path(lm)
    assert load_drafter(lm, "auto", remember=False).path is None
    with pytest.raises(AcceleratorError, match="train --method medusa"):
        load_drafter(lm, "medusa+lookup")
    with pytest.raises(AcceleratorError, match="train --method kangaroo"):
        load_drafter(lm, "kangaroo+lookup")
