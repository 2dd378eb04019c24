"""Turning service results into what people read: the live speed readout under a reply,
the plots after it, the Compare verdict and the training progress. Pure formatting."""

from __future__ import annotations

import html

import pandas as pd

from app.drafting import accel_label
from app.jobs import Job
from app.replies import CompareResult, ReplyUpdate
from engine.progress import Progress
from engine.stats import CTAR_WINDOWS, GenerationStats

STOP_REASONS = {"eos": "finished", "length": "hit the token limit", "stop": "stop string",
                "cancelled": "stopped"}


def _chip(text: str, cls: str = "") -> str:
    return f'<span class="qd-chip {cls}">{text}</span>'


def _row(chips: str) -> str:
    return f'<div class="qd-readout">{chips}</div>'


def _speed_chips(method: str, tokens_per_s: float, ttft_s: float, per_step: float) -> list[str]:
    """What a reply's readout starts with, streaming or stored."""
    return [_chip(html.escape(accel_label(method)), "qd-method"),
            _chip(f"<b>{tokens_per_s:.1f}</b> tok/s", "qd-tps"),
            _chip(f"TTFT <b>{ttft_s:.2f}</b> s"),
            _chip(f"<b>{per_step:.2f}</b> tokens/step")]


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
    """The line under a streaming reply: method, tokens/s, TTFT, tokens per step."""
    per_step = GenerationStats(accepted=update.accepted).mean_accepted or 1.0
    parts = _speed_chips(update.method, update.tokens_per_s, update.ttft_s, per_step)
    parts.append(mini_histogram(update.accepted) if not update.method.endswith("off") else "")
    if update.done and update.stats is not None:
        reason = STOP_REASONS.get(update.stats.stop_reason, update.stats.stop_reason)
        parts.append(_chip(f"{update.tokens} tokens · {reason}", "qd-done"))
        if update.stats.datastore_drafted:
            parts.append(_chip(f"datastore <b>{update.stats.datastore_accepted}</b> of "
                               f"{update.stats.datastore_drafted} drafts kept", "qd-datastore"))
    else:
        parts.append(_chip(f"{update.tokens} tokens…", "qd-live"))
    notes = "".join(f'<div class="qd-note">{html.escape(n)}</div>' for n in update.notices)
    return _row("".join(parts)) + notes


def live_readout_waiting() -> str:
    return _row(_chip("waiting for the first token…", "qd-live"))


def error_html(message: str) -> str:
    return f'<div class="qd-error">{html.escape(message)}</div>'


def accepted_frame(stats: GenerationStats) -> pd.DataFrame:
    """Steps by tokens added, for the bar plot after a reply."""
    counts = histogram_counts(stats.accepted)
    return pd.DataFrame({"tokens per step": [str(k) for k in range(1, len(counts) + 1)],
                         "steps": counts})


def ctar_frame(stats: GenerationStats) -> pd.DataFrame:
    """CTAR(w): share of steps whose first w drafted tokens were all accepted."""
    return pd.DataFrame({"window": [str(w) for w in range(1, CTAR_WINDOWS + 1)],
                         "CTAR": stats.ctar()})


def compare_html(result: CompareResult) -> str:
    """Compare's verdict: both speeds, their ratio and whether the texts match."""
    label = accel_label(result.method)
    prompt = html.escape(result.prompt if len(result.prompt) < 80 else result.prompt[:77] + "…")
    head = f'<div class="qd-compare-prompt">Greedy replay of “{prompt}”</div>'
    if result.off is None:
        return head + _row(_chip("running Off…", "qd-live"))
    off = _chip(f"Off <b>{result.off.tokens_per_s:.1f}</b> tok/s")
    if result.on is None:
        return head + _row(off + _chip(f"running {label}…", "qd-live"))
    on = _chip(f"{label} <b>{result.on.tokens_per_s:.1f}</b> tok/s")
    ratio = _chip(f"<b>{result.ratio:.2f}×</b>", "qd-ratio")
    d = result.divergence
    if result.identical:
        same = _chip("identical text", "qd-same")
    elif d is None:  # stopped early: the replies were not compared
        same = _chip("texts differ", "qd-differ")
    else:  # a near-tie is within the dtype's rounding; anything else is a defect
        same = _chip("texts differ: " + html.escape(d.verdict(result.dtype)),
                     "qd-differ" if d.near_tie else "qd-mismatch")
    steps = _chip(f"{result.on.mean_accepted:.2f} tokens/step")
    tail = _chip("stopped early: figures are partial", "qd-differ") if result.stopped else ""
    return head + _row(off + on + ratio + same + steps + tail)


def job_html(job: Job | None) -> str:
    """A progress bar with the stage, ETA and latest figures of a background job."""
    if job is None:
        return ""
    p = job.progress or Progress("starting", 0, 0)
    if job.state == "running":
        eta = f" · about {_duration(p.eta_s)} left" if p.eta_s else ""
        state = f"{html.escape(p.stage)}{eta}"
    elif job.state == "failed":
        state = f"failed: {html.escape(job.error)}"
    else:
        state = job.state
    figures = " · ".join(f"{html.escape(k)} {v:.3g}" for k, v in p.metrics.items()
                         if isinstance(v, (int, float)))
    return (f'<div class="qd-job qd-{job.state}"><div class="qd-job-title">'
            f"{html.escape(job.title)}: {state}</div>"
            f'<div class="qd-progress"><div style="width:{100 * p.fraction:.1f}%"></div></div>'
            f'<div class="qd-job-msg">{html.escape(p.message)}</div>'
            f'<div class="qd-job-figures">{figures}</div></div>')


def metric_frames(job: Job | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(loss, accuracy) over time from a job's metric reports, in long format."""
    rows_loss, rows_acc = [], []
    for row in job.history if job is not None else []:
        for key, value in row.items():
            if key == "t" or not isinstance(value, (int, float)):
                continue
            point = {"minutes": round(row["t"] / 60, 2), "value": round(value, 4), "metric": key}
            if "loss" in key:
                rows_loss.append(point)
            elif 0.0 <= value <= 1.0:
                rows_acc.append(point)
    columns = ["minutes", "value", "metric"]
    return pd.DataFrame(rows_loss, columns=columns), pd.DataFrame(rows_acc, columns=columns)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def saved_readout(message: dict) -> str:
    """The readout of a stored reply (shown when a conversation is opened again)."""
    stats = message.get("stats") or {}
    if not stats:
        return ""
    parts = _speed_chips(message.get("accel", "off"), stats.get("tokens_per_s", 0),
                         stats.get("ttft_s", 0), stats.get("mean_accepted", 0) or 1)
    parts.append(_chip(f"{stats.get('tokens', 0)} tokens · "
                       f"{STOP_REASONS.get(stats.get('stop_reason', ''), '')}", "qd-done"))
    return _row("".join(parts))


CSS = """
.qd-readout {display:flex; flex-wrap:wrap; gap:6px; align-items:center; font-size:0.9em;}
.qd-chip {padding:2px 8px; border-radius:10px; background:var(--block-background-fill);
  border:1px solid var(--border-color-primary); white-space:nowrap;}
.qd-method {background:var(--color-accent-soft); font-weight:600;}
.qd-ratio {background:#d1fae5; color:#065f46;} .qd-same {color:#047857;}
.qd-differ {color:#b45309;} .qd-mismatch {color:#dc2626; font-weight:600;}
.qd-live {opacity:0.7;}
.qd-hist {display:inline-flex; gap:2px; align-items:flex-end; height:30px;}
.qd-bar {display:inline-flex; flex-direction:column; align-items:center; width:12px;}
.qd-bar i {display:block; width:9px; background:var(--color-accent); border-radius:2px;}
.qd-bar small {font-size:0.65em; line-height:1;}
.qd-note {font-size:0.85em; opacity:0.8;} .qd-error {color:#b91c1c; font-weight:500;}
.qd-compare-prompt {font-size:0.85em; opacity:0.75; margin-bottom:4px;}
.qd-progress {height:10px; background:var(--border-color-primary); border-radius:5px;
  overflow:hidden; margin:6px 0;}
.qd-progress div {height:100%; background:var(--color-accent);}
.qd-job-title {font-weight:600;} .qd-job-msg, .qd-job-figures {font-size:0.9em;}
"""
