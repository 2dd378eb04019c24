"""PNG plots of a report: speedup per method and category, CTAR curves, accepted lengths.

Uses matplotlib's object API (Figure + its Agg canvas), so no global pyplot state or
display backend is involved.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.methods import BASELINE, OVERALL


def write_plots(report: dict, out: Path) -> list[Path]:
    """speedup.png, ctar.png and accepted_hist.png in `out`; returns their paths."""
    paths = [out / "speedup.png", out / "ctar.png", out / "accepted_hist.png"]
    for draw, path in zip((_speedup, _ctar, _accepted_hist), paths, strict=True):
        fig = Figure(figsize=(9, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig.add_subplot(), report)
        fig.savefig(path, dpi=110)
    return paths


def _speedup(ax, report: dict) -> None:
    """Grouped bars: x = categories and the pooled column, one bar per method."""
    methods = {k: v for k, v in report["methods"].items() if k != BASELINE}
    categories = list(next(iter(report["methods"].values()))["by_category"])
    groups = [*categories, OVERALL]
    width = 0.8 / max(1, len(methods))
    for i, (name, f) in enumerate(methods.items()):
        values = [f["by_category"][c]["speedup_vs_hf"] for c in categories] + [f["speedup_vs_hf"]]
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(f"speedup over {BASELINE} (median of per-prompt ratios)")
    ax.set_title("Speedup per method and category")
    if methods:
        ax.legend(fontsize="small")


def _ctar(ax, report: dict) -> None:
    """CTAR(w): share of steps whose first w drafted tokens were all accepted."""
    for name, f in report["methods"].items():
        if f["ctar"] is not None:
            windows = range(1, len(f["ctar"]) + 1)
            ax.plot(windows, f["ctar"], marker="o", label=name)
    ax.set_xlabel("window w (draft tokens)")
    ax.set_ylabel("CTAR(w)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Consecutive-token acceptance rate")
    ax.legend(fontsize="small")


def _accepted_hist(ax, report: dict) -> None:
    """Share of full-model steps that added k tokens (k = accepted drafts + 1)."""
    hists = {k: v["accepted_histogram"] for k, v in report["methods"].items()
             if v["accepted_histogram"]}
    longest = max((len(h) for h in hists.values()), default=2)
    width = 0.8 / max(1, len(hists))
    for i, (name, counts) in enumerate(hists.items()):
        steps = sum(counts) or 1
        ks = range(1, len(counts))
        xs = [k + (i - (len(hists) - 1) / 2) * width for k in ks]
        ax.bar(xs, [counts[k] / steps for k in ks], width, label=name)
    ax.set_xticks(range(1, longest))
    ax.set_xlabel("tokens added per full-model step")
    ax.set_ylabel("share of steps")
    ax.set_title("Accepted length per step")
    if hists:
        ax.legend(fontsize="small")
