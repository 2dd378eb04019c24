"""The near-tie verdict is measured: the plain model's logit gap at the first differing token
against the dtype's rounding there, in Compare and in the bench report."""

from __future__ import annotations

import pytest
import torch

from app.replies import CompareResult
from app.ui.readout import compare_html
from bench.report import divergences, notes, summarize
from bench.runner import Measurement
from engine.config import SamplingParams
from engine.decode.generate import run
from engine.decode.neartie import ROUNDING_SPACINGS, Divergence, first_difference, judge, measure
from engine.decode.stats import GenerationStats
from tests.conftest import make_tiny_model

PROMPT = list(range(30, 50))


@pytest.fixture
def tiny(bundled_tokenizer):
    return make_tiny_model("llama-untied", bundled_tokenizer, num_layers=2)


def _reply(lm, n=12) -> list[int]:
    return run(lm, PROMPT, SamplingParams(max_new_tokens=n))[1]


def _logits_after(lm, ids: list[int]) -> torch.Tensor:
    """The plain model's (V,) logits for the token after `ids`, from a full forward."""
    with torch.inference_mode():
        return lm.model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_first_difference_counts_a_reply_that_ends_early():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_the_same_gap_is_a_near_tie_in_bf16_and_a_mismatch_in_fp32():
    logits = torch.zeros(10)
    logits[3], logits[7] = 20.0, 19.9  # top-2 gap 0.1 at a logit of 20
    bf16 = judge(logits, 4, 3, 7, torch.bfloat16)
    fp32 = judge(logits, 4, 3, 7, torch.float32)
    assert bf16.gap == pytest.approx(0.1, abs=1e-5) == fp32.gap
    # bf16 spacing at 20: 2^-7 * 20 = 0.156; fp32: 2^-23 * 20 = 2.4e-6
    assert bf16.tolerance == pytest.approx(ROUNDING_SPACINGS * 2**-7 * 20)
    assert bf16.near_tie and not fp32.near_tie
    # A run that picked the 5th-best token is no near-tie, whatever the top-2 gap.
    assert not judge(logits, 4, 3, 0, torch.bfloat16).near_tie


def test_a_wrong_token_is_a_mismatch_at_its_position(tiny):
    reference = _reply(tiny)
    n = 5
    logits = _logits_after(tiny, PROMPT + reference[:n])
    worst = int(logits.argmin())  # what a defective drafter might have let through
    other = [*reference[:n], worst, *reference[n + 1:]]
    d = measure(tiny, PROMPT, reference, other)
    assert (d.position, d.expected, d.got) == (n, reference[n], worst)
    assert d.gap == pytest.approx(float(logits[reference[n]] - logits[worst]), rel=1e-4)
    assert not d.near_tie and "MISMATCH at token 6" in d.verdict("float32")


def test_two_tokens_the_model_scores_alike_are_a_near_tie(tiny):
    reference = _reply(tiny)
    n = 4
    twin = (reference[n] + 1) % tiny.model.config.vocab_size
    head = tiny.model.get_output_embeddings().weight
    with torch.no_grad():  # the untied LM head scores `twin` exactly like the chosen token
        head[twin] = head[reference[n]]
    other = [*reference[:n], twin, *reference[n + 1:]]
    d = measure(tiny, PROMPT, reference, other)
    assert d.position == n and d.gap == 0.0 and d.near_tie
    assert d.verdict("float32").startswith("near-tie (gap 0,")


def _compare(divergence: Divergence | None) -> CompareResult:
    stats = GenerationStats(tokens=10, elapsed_s=1.0)
    return CompareResult("medusa", "hi", stats, stats, identical=False,
                         divergence=divergence, dtype="bfloat16")


def test_compare_shows_a_near_tie_plainly_and_a_mismatch_in_red():
    tie = compare_html(_compare(Divergence(11, 5, 6, 0.03, 0.12)))
    assert "a rounding tie at token 12" in tie and "(gap 0.03, rounding 0.12)" in tie
    assert "qd-mismatch" not in tie
    bad = compare_html(_compare(Divergence(11, 5, 6, 2.5, 0.12)))
    assert 'qd-mismatch">texts differ: MISMATCH at token 12' in bad


def test_service_compare_calls_a_wrong_token_in_bf16_a_mismatch(tiny, tmp_path, monkeypatch):
    import app.reply_core as core_module
    from app.replies import ReplyRequest
    from app.service import Service
    from app.store import Store
    from engine.config import ModelSpec
    from engine.model.loading import wrap_model
    from tests.app.test_service import _untrained_medusa

    # Reduced precision, where Compare used to call any difference a flipped near-tie.
    tiny = wrap_model(tiny.model.to(torch.bfloat16), tiny.tokenizer,
                      ModelSpec(source="tiny-bf16"), "tiny-bf16", "bf16")

    real_run = core_module.run  # Compare's runs go through the reply core

    def wrong_with_a_drafter(lm, ids, params, drafter=None, cancel=None):
        text, out, stats = real_run(lm, ids, params, drafter, cancel)
        if drafter is not None and len(out) > 3:  # the accelerated side lets a bad token out
            out = [*out[:3], int(_logits_after(lm, list(ids) + out[:3]).argmin()), *out[4:]]
        return text, out, stats

    _untrained_medusa(tiny)
    service = Service(Store(tmp_path / "data"), tiny)
    monkeypatch.setattr(core_module, "run", wrong_with_a_drafter)
    request = ReplyRequest("", SamplingParams(temperature=0.0, max_new_tokens=8), "medusa")
    final = list(service.replies.compare(request))[-1]
    assert final.identical is False and final.dtype == "bfloat16"
    assert final.divergence.position == 3 and not final.divergence.near_tie
    assert "MISMATCH at token 4" in compare_html(final)


def _m(method, prompt, ids):
    return Measurement(method, prompt, "qa", len(PROMPT), ids, 1.0, 0.1, [0] * len(ids), 1.0, 1.0)


def test_bench_report_names_each_mismatch_and_each_near_tie(tiny):
    reference = _reply(tiny, 8)
    wrong = [*reference[:2], int(_logits_after(tiny, PROMPT + reference[:2]).argmin()),
             *reference[3:]]
    twin = (reference[6] + 1) % tiny.model.config.vocab_size
    with torch.no_grad():
        head = tiny.model.get_output_embeddings().weight
        head[twin] = head[reference[6]]
    tied = [*reference[:6], twin, *reference[7:]]
    results = [_m("hf", 0, reference), _m("bad", 0, wrong), _m("tie", 0, tied),
               _m("same", 0, reference)]
    verdicts = divergences(tiny, [PROMPT], results)
    assert set(verdicts) == {("bad", 0), ("tie", 0)}
    methods = summarize(results, greedy=True, verdicts=verdicts)
    (bad,) = methods["bad"]["mismatches"]
    assert bad["prompt"] == 0 and bad["position"] == 2 and not bad["near_tie"]
    assert methods["tie"]["mismatches"][0]["near_tie"] and methods["same"]["mismatches"] == []
    report = {"settings": {"temperature": 0, "dtype": "float32"}, "methods": methods,
              "skipped": {}, "measurements": []}
    text = "\n".join(notes(report))
    assert "MISMATCH: bad differs from hf on 1 of 1 prompts beyond float32 rounding" in text
    assert "prompts 0 at token 3 (gap" in text
    assert "tie differs from hf on 1 of 1 prompts by a near-tie within float32 rounding" in text
    assert "MISMATCH: tie" not in text
