"""The speed report's noise and variants: each pass's own speedup and its spread in the
tables, and the bench-only variants an adaptive mechanism is measured against."""

from __future__ import annotations

from engine.benchmark.methods import VARIANTS, build_methods
from engine.benchmark.report import category_table, summarize
from engine.config import SamplingParams
from tests.conftest import make_tiny_model
from tests.test_bench import _m, near


def test_each_pass_gives_its_own_speedup_and_the_report_its_spread():
    def passes(m, speeds):
        m.passes = speeds
        return m

    results = [
        passes(_m("hf", 0, "qa", [1, 2], 1.0, [0]), [2.0, 2.0, 2.0]),
        passes(_m("fast", 0, "qa", [1, 2], 0.5, [1]), [4.0, 5.0, 3.0]),  # 2x, 2.5x, 1.5x
        passes(_m("hf", 1, "qa", [3, 4], 1.0, [0]), [2.0, 2.0, 2.0]),
        passes(_m("fast", 1, "qa", [3, 4], 0.5, [1]), [4.0, 4.0, 4.0]),  # 2x each pass
    ]
    report = {"methods": summarize(results, greedy=True)}
    fast = report["methods"]["fast"]
    assert fast["speedup_vs_hf_passes"] == near([2.0, 2.25, 1.75])  # median of two prompts
    assert fast["same_text"]["speedup_vs_hf_passes"] == near([2.0, 2.25, 1.75])
    assert "±0.25" in "\n".join(category_table(report, "speedup_vs_hf"))


def test_the_bench_variants_decode_exactly(bundled_tokenizer):
    """Lookup with HF's fixed 10-token chain: the variant Lookup's adaptive draft length
    is measured against."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=2)
    params = SamplingParams(max_new_tokens=24)
    methods, skipped = build_methods(lm, ["hf", "vanilla", *VARIANTS], params)
    assert not skipped and set(methods) == {"hf", "vanilla", *VARIANTS}
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    want = methods["vanilla"].generate(prompt).ids
    for name in VARIANTS:
        assert methods[name].generate(prompt).ids == want
