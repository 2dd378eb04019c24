"""Turning service results into what people read: the speed readout under a reply (what it
came from included), the plots after it, the Compare verdict and a background job's progress.
Pure formatting. Every figure says which reply or run it belongs to."""

from __future__ import annotations

import html
import re

import pandas as pd

from app.drafting import accel_label
from app.jobs import Job
from app.replies import CompareResult, ReplyUpdate
from app.sources import SourceMix, label, mix_of
from app.speed_record import BUSY_SHARE
from engine.decode.stats import CTAR_WINDOWS, GenerationStats
from engine.progress import Progress

STOP_REASONS = {"eos": "finished", "length": "hit the token limit", "stop": "stop string",
                "cancelled": "stopped"}
# What each figure means, on hover (the page's "What these figures mean" says more).
TIPS = {
    "tps": "tokens of this reply per second, from when the model took it up to its last "
           "token (time waiting in the queue is not counted)",
    "ttft": "time to first token: reading the prompt and choosing the first token",
    "step": "tokens added per full-model step: accepted draft tokens plus the model's own "
            "(1.00 is plain decoding)",
    "sources": "which source drafted each full-model step of this reply",
}
REPEATED_FLAG = 0.5  # Compare warns when more of the gain than this repeated earlier text
# The engine and the trainer speak of the command line; the page of its own controls.
CONTROL_WORDS = [
    (re.compile(r"run: python launcher\.py train --method (\w+)"),
     r"train it again on the Train accelerator tab (method: \1)"),
    (re.compile(r"with --max-minutes"), "with the Time budget slider"),
    (re.compile(r"--max-minutes"), "the time budget"),
    (re.compile(r"--prompts"), "Extra prompts"),
    (re.compile(r"--no-chats"), "Learn from my chats"),
]


def page_words(message: str) -> str:
    """An engine's or trainer's message with the command line named as the page's controls."""
    for pattern, words in CONTROL_WORDS:
        message = pattern.sub(words, message)
    return message


def _chip(text: str, cls: str = "", tip: str = "") -> str:
    title = f' title="{html.escape(tip)}"' if tip else ""
    return f'<span class="qd-chip {cls}"{title}>{text}</span>'


def _row(chips: str) -> str:
    return f'<div class="qd-readout">{chips}</div>'


def _speed_chips(which: str, method: str, tokens_per_s: float, ttft_s: float,
                 per_step: float) -> list[str]:
    """What a reply's readout starts with, streaming or stored: the method it was asked with
    ("auto:kangaroo" -> "Auto": which sources made its steps is said beside it, not the arm
    Auto had ready)."""
    return [_chip(which, "qd-which"),
            _chip(html.escape(accel_label(method.split(":")[0])), "qd-method"),
            _chip(f"<b>{tokens_per_s:.1f}</b> tok/s", "qd-tps", TIPS["tps"]),
            _chip(f"TTFT <b>{ttft_s:.2f}</b> s", "qd-ttft", TIPS["ttft"]),
            _chip(f"<b>{per_step:.2f}</b> tokens/step", "qd-per-step", TIPS["step"])]


def sources_chip(mix: SourceMix | None) -> str:
    """The share of the reply's steps each source made, the largest (named first) in bold,
    and the sources that drafted no step of their own but joined steps another drafted
    (their tokens grafted on): no source that drafted is left out."""
    if mix is None or not mix.total_steps:
        return ""
    shares = [f"{html.escape(label(s))} {100 * f:.0f}%" for s, f in mix.shares()]
    shares[0] = f"<b>{shares[0]}</b>"
    joined = [f"{html.escape(label(s))} joined {n} of them" for s, n in
              sorted(mix.joined.items(), key=lambda kv: (-kv[1], kv[0]))
              if n and not mix.steps.get(s)]
    return _chip("steps: " + " · ".join(shares + joined), "qd-sources", TIPS["sources"])


def histogram_counts(accepted: list[int]) -> list[int]:
    """counts[k - 1] = steps that added k tokens (accepted drafts + the model's own)."""
    return GenerationStats(accepted=list(accepted)).accepted_histogram()[1:]


def mini_histogram(accepted: list[int]) -> str:
    """Inline bars: how many steps added 1, 2, 3... tokens."""
    counts = histogram_counts(accepted)
    if not accepted:
        return ""
    top = max(counts)
    bars = "".join(
        f'<span class="qd-bar" title="{c} steps added {k} token{"s" * (k > 1)}">'
        f'<i style="height:{max(2, round(18 * c / top))}px"></i><small>{k}</small></span>'
        for k, c in enumerate(counts, start=1)
    )
    return f'<span class="qd-hist" title="tokens added per step">{bars}</span>'


def live_readout(update: ReplyUpdate) -> str:
    """The line under a streaming reply: method, tokens/s, TTFT, tokens per step; once it
    ends, how it ended and which sources made its steps."""
    stats = update.stats
    parts = _speed_chips("this reply", update.method, stats.tokens_per_s, stats.ttft_s,
                         stats.mean_accepted or 1.0)
    parts.append(mini_histogram(stats.accepted) if not update.method.endswith("off") else "")
    if update.done:
        reason = STOP_REASONS.get(stats.stop_reason, stats.stop_reason)
        parts.append(_chip(f"{stats.tokens} tokens · {reason}", "qd-done"))
        parts.append(sources_chip(mix_of(update.method, stats.to_json())))
        if stats.datastore_drafted:
            parts.append(_chip(f"datastore <b>{stats.datastore_accepted}</b> of "
                               f"{stats.datastore_drafted} drafts kept", "qd-datastore"))
    else:
        parts.append(_chip(f"{stats.tokens} tokens…", "qd-live"))
    return _row("".join(parts)) + "".join(map(note_html, update.notices))


def saved_readout(message: dict) -> str:
    """The readout of a stored reply, labelled as such (shown when a conversation opens)."""
    stats = message.get("stats") or {}
    if not stats:
        return ""
    method = message.get("accel", "off")
    parts = _speed_chips("last reply in this chat", method, stats.get("tokens_per_s", 0),
                         stats.get("ttft_s", 0), stats.get("mean_accepted", 0) or 1)
    parts.append(_chip(f"{stats.get('tokens', 0)} tokens · "
                       f"{STOP_REASONS.get(stats.get('stop_reason', ''), '')}", "qd-done"))
    parts.append(sources_chip(mix_of(method, stats)))
    return _row("".join(parts))


def live_readout_waiting() -> str:
    return _row(_chip("waiting for the first token…", "qd-live"))


def error_html(message: str) -> str:
    return f'<div class="qd-error">{html.escape(message)}</div>'


def note_html(message: str) -> str:
    return f'<div class="qd-note">{html.escape(message)}</div>'


def accepted_frame(stats: GenerationStats) -> tuple[pd.DataFrame, list[str]]:
    """Steps by tokens added, for the bar plot after a reply, and the bars' order (the
    labels are text: as numbers the bars would be drawn as thin marks on a number line)."""
    counts = histogram_counts(stats.accepted)
    order = [str(k) for k in range(1, len(counts) + 1)]
    return pd.DataFrame({"tokens per step": order, "steps": counts}), order


def ctar_frame(stats: GenerationStats) -> pd.DataFrame:
    """CTAR(w): share of steps whose first w drafted tokens were all accepted."""
    return pd.DataFrame({"window": [str(w) for w in range(1, CTAR_WINDOWS + 1)],
                         "CTAR": stats.ctar()})


def compare_html(result: CompareResult, slower_note: str = "") -> str:
    """Compare's verdict: both speeds, their ratio (with `slower_note`, what Auto does,
    when it is below 1), whether the texts match, what the accelerated run's speed came from
    (flagged when mostly repeated text) and whether other programs were busy meanwhile."""
    label_ = accel_label(result.method)
    prompt = html.escape(result.prompt if len(result.prompt) < 80 else result.prompt[:77] + "…")
    head = f'<div class="qd-compare-prompt">Greedy replay of “{prompt}”</div>'
    if result.off is None:
        return head + _row(_chip("running Off…", "qd-live"))
    off = _chip(f"Off <b>{result.off.tokens_per_s:.1f}</b> tok/s")
    if result.on is None:
        return head + _row(off + _chip(f"running {label_}…", "qd-live"))
    on = _chip(f"{label_} <b>{result.on.tokens_per_s:.1f}</b> tok/s")
    ratio = ratio_chip(result.ratio, drafted=result.on.mean_accepted > 1.0)
    steps = _chip(f"{result.on.mean_accepted:.2f} tokens/step", tip=TIPS["step"])
    tail = _chip("stopped early: figures are partial", "qd-differ") if result.stopped else ""
    if result.busy is not None and result.busy > BUSY_SHARE:
        tail += _chip(f"taken while other programs used {100 * result.busy:.0f}% of the CPU",
                      "qd-differ", "a busy machine slows both runs unevenly: Compare again "
                      "when it is idle")
    mix = mix_of(result.method, result.on.to_json())
    note = f'<div class="qd-slower">{html.escape(slower_note)}</div>' if slower_note else ""
    return (head + _row(off + on + ratio + sameness(result) + steps + sources_chip(mix) + tail)
            + note + tie_details(result) + repeated_note(mix))


def ratio_chip(ratio: float | None, drafted: bool = True) -> str:
    """The accelerated run's speed over Off's: green only when faster by drafting (a run
    that kept no draft made Off's steps, so its ratio is the clock's noise)."""
    if ratio is None:
        return ""
    tip = "accelerated speed over Off's, same prompt, one run each"
    if not drafted:
        return _chip(f"<b>{ratio:.2f}×</b>", "qd-ratio qd-plain", tip) + _chip(
            "no draft kept: the same steps as Off, so the difference is timing noise",
            "qd-differ")
    if ratio >= 1.0:
        return _chip(f"<b>{ratio:.2f}×</b>", "qd-ratio", tip)
    return _chip(f"<b>{ratio:.2f}×</b>", "qd-ratio qd-slow", tip) + _chip(
        "slower than Off", "qd-slow")


def sameness(result: CompareResult) -> str:
    """Whether the texts match: identical, the same up to a rounding tie (calm: batched
    verification may round a near-tie the other way outside fp32), or a real mismatch."""
    d = result.divergence
    if result.identical:
        return _chip("identical text", "qd-same")
    if d is None:  # stopped early: the replies were not compared
        return _chip("texts not compared (stopped)", "qd-differ")
    if d.near_tie:
        return _chip(f"same reply up to a rounding tie at token {d.position + 1}", "qd-same")
    return _chip("texts differ: " + html.escape(d.verdict(result.dtype)), "qd-mismatch")


def tie_details(result: CompareResult) -> str:
    """What a rounding tie means, behind a click."""
    d = result.divergence
    if result.identical or d is None or not d.near_tie:
        return ""
    return (f'<details class="qd-details"><summary>What a rounding tie is</summary>At token '
            f"{d.position + 1} the model's two best next tokens were within "
            f"{result.dtype}'s rounding of each other (gap {d.gap:.3g}, rounding "
            f"{d.tolerance:.3g}), and verifying several tokens at once rounds a little "
            "differently from one at a time, so the accelerated reply took the other one "
            "and went on from there. Both are the model's own choices. In fp32 the texts "
            "are identical: Quickdraft's tests check every method token for token there."
            "</details>")


def repeated_note(mix: SourceMix | None) -> str:
    """A warning when most accepted draft tokens repeated text the model saw before."""
    if mix is None or mix.repeated_share <= REPEATED_FLAG:
        return ""
    return (f'<div class="qd-repeated">{100 * mix.repeated_share:.0f}% of the drafted tokens '
            "the model accepted repeated text it had seen before (in this conversation, the "
            "prompt included, or in the datastore of its earlier replies): this speedup comes "
            "mostly from repetition, and a reply in fresh words will gain less.</div>")


def job_html(job: Job | None, error: str | None = None) -> str:
    """A progress bar over the whole job (it never goes back, and stops in grey or red once
    the job was cancelled or failed), its stage, ETA and figures (those its message does not
    already give). `error`: the failure in the page's words, where they differ."""
    if job is None:
        return ""
    p = job.progress or Progress("starting", 0, 0)
    if job.state == "running":
        eta = f" · about {_duration(p.eta_s)} left" if p.eta_s else ""
        state = f"{html.escape(p.stage)}{eta}"
    elif job.state == "failed":
        state = f"failed: {html.escape(error or job.error)}"
    else:
        state = job.state
    figures = " · ".join(f"{html.escape(k)} {v:.3g}" for k, v in p.metrics.items()
                         if _is_number(v) and k not in p.message)
    return (f'<div class="qd-job qd-{job.state}"><div class="qd-job-title">'
            f"{html.escape(job.title)}: {state}</div>"
            f'<div class="qd-progress" title="the whole run">'
            f'<div style="width:{100 * job.fraction:.1f}%"></div></div>'
            f'<div class="qd-job-msg">{html.escape(p.message)}</div>'
            f'<div class="qd-job-figures">{figures}</div></div>')


def metric_frames(job: Job | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(loss, held-out accuracy) over the run's minutes from a job's metric reports, in
    long format with numeric columns (even when empty: a text column would make the chart's
    axis a list of labels)."""
    rows_loss, rows_acc = [], []
    for row in job.history if job is not None else []:
        for key, value in row.items():
            if key == "t" or not _is_number(value):
                continue
            point = {"minutes": row["t"] / 60, "value": float(value), "metric": key}
            if "loss" in key:
                rows_loss.append(point)
            elif 0.0 <= value <= 1.0:
                rows_acc.append(point)
    return _frame(rows_loss), _frame(rows_acc)


def _frame(rows: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=["minutes", "value", "metric"])
    return frame.astype({"minutes": float, "value": float, "metric": str})


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
