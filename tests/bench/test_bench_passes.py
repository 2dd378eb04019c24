"""The speed report's noise: each pass's own speedup and its spread in the tables."""

from __future__ import annotations

from bench.report import category_table, summarize
from tests.bench.test_bench import _m, near


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
