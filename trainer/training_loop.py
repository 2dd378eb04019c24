"""The one training loop every drafter uses: AdamW, warm-up then cosine decay, epochs over
cached features, a time budget, and best-so-far weights kept on cancel."""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.progress import Progress, ProgressFn, ignore

# batches_fn(epoch) -> the epoch's batches (any objects loss_fn understands).
BatchesFn = Callable[[int], Sequence]
# loss_fn(module, batch) -> (scalar loss to minimise, {name: float} metrics to report).
LossFn = Callable[[torch.nn.Module, object], tuple[torch.Tensor, dict]]
# eval_fn(module) -> held-out loss (lower is better) used to keep the best weights, or
# (loss, {name: float}) whose figures are reported as training proceeds (held-out accuracy
# per head, agreement), so a user sees what the run is buying.
EvalFn = Callable[[torch.nn.Module], float | tuple[float, dict]]


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser and schedule for train_module."""

    lr: float = 3e-3  # peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decays
    warmup: float = 0.05  # fraction of the run spent warming up linearly
    min_lr_ratio: float = 0.05  # cosine floor as a fraction of the peak
    epochs: int = 3  # passes over batches_fn's batches
    max_seconds: float | None = None  # wall-clock budget; the schedule completes within it
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    report_every: int = 10  # steps between progress reports
    evals_per_epoch: int = 1  # held-out evaluations per epoch (best weights are kept)


def lr_factor(progress: float, config: TrainConfig) -> float:
    """Schedule multiplier at `progress` in [0, 1]: linear warm-up, then cosine to the floor."""
    if config.warmup > 0 and progress < config.warmup:
        return max(progress / config.warmup, 1e-3)
    rest = (progress - config.warmup) / max(1e-9, 1 - config.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, rest)))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def train_module(module: torch.nn.Module, batches_fn: BatchesFn, loss_fn: LossFn,
                 config: TrainConfig, progress: ProgressFn = ignore,
                 cancel: threading.Event | None = None, eval_fn: EvalFn | None = None) -> dict:
    """Train `module`'s parameters that require grad; returns the run's figures.

    The schedule runs on max(step fraction, time fraction), so a time-limited run still
    decays its learning rate. On cancel or time-out the loop stops between steps; the
    module ends with the weights of the best held-out evaluation (eval_fn), or the last
    ones when there is no eval_fn.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=config.betas,
                            weight_decay=config.weight_decay)
    first = batches_fn(0)
    steps_per_epoch = max(1, len(first))
    total = steps_per_epoch * config.epochs
    eval_at = {round(steps_per_epoch * (i + 1) / config.evals_per_epoch)
               for i in range(config.evals_per_epoch)}
    start, step, stopped, evaluated = time.perf_counter(), 0, "", -1
    best = {"loss": math.inf, "state": None, "step": 0, "curve": [], "shown": ""}
    smoothed, metrics = None, {}
    module.train()
    for epoch in range(config.epochs):
        for i, batch in enumerate(first if epoch == 0 else batches_fn(epoch)):
            stopped = _stop_reason(start, config, cancel)
            if stopped:
                break
            frac = max(step / total, _time_fraction(start, config))
            lr = config.lr * lr_factor(frac, config)
            value, metrics = _optimizer_step(module, opt, params, loss_fn, batch, lr, config)
            step += 1
            smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
            if eval_fn is not None and (i + 1) in eval_at:
                _evaluate(module, eval_fn, best, step)
                evaluated = step
            if step % config.report_every == 0 or step == total or evaluated == step:
                _report(progress, step, total, start, config, smoothed, metrics, best,
                        evaluated == step)
        if stopped:
            break
    if eval_fn is not None and evaluated != step:  # the last weights were not evaluated yet
        _evaluate(module, eval_fn, best, step)
        if smoothed is not None:
            _report(progress, step, total, start, config, smoothed, metrics, best, True)
    if best["state"] is not None:
        module.load_state_dict(best["state"])
    module.eval()
    return {
        "steps": step,
        "epochs": round(step / steps_per_epoch, 2),
        "seconds": round(time.perf_counter() - start, 1),
        "train_loss": smoothed,
        "best_eval_loss": None if best["state"] is None else best["loss"],
        "best_step": best["step"],
        "heldout_curve": best["curve"],
        "stopped": stopped or "done",
        **{f"last_{k}": v for k, v in metrics.items()},
    }


def _time_fraction(start: float, config: TrainConfig) -> float:
    if not config.max_seconds:
        return 0.0
    return (time.perf_counter() - start) / config.max_seconds


def _optimizer_step(module, opt, params, loss_fn: LossFn, batch, lr: float,
                    config: TrainConfig) -> tuple[float, dict]:
    """One AdamW update at learning rate `lr`; returns (loss, metrics)."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss, metrics = loss_fn(module, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip:
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    opt.step()
    return float(loss.detach()), metrics


def _stop_reason(start: float, config: TrainConfig, cancel: threading.Event | None) -> str:
    if cancel is not None and cancel.is_set():
        return "cancelled"
    if config.max_seconds is not None and time.perf_counter() - start >= config.max_seconds:
        return "time"
    return ""


def _evaluate(module: torch.nn.Module, eval_fn: EvalFn, best: dict, step: int) -> None:
    """Run the held-out evaluation, keep its figures for the progress line and the run's
    curve, and keep a copy of the weights when they are the best."""
    module.eval()
    with torch.no_grad():
        result = eval_fn(module)
    module.train()
    loss, figures = result if isinstance(result, tuple) else (result, {})
    loss = float(loss)
    if figures:
        best["curve"].append({"step": step, **figures})
        # shown with every step's report from now on
        best["shown"] = ", ".join(f"{k} {v:.1%}" for k, v in figures.items())
    if loss < best["loss"]:
        best.update(loss=loss, state=copy.deepcopy(module.state_dict()), step=step)


def _report(progress: ProgressFn, step: int, total: int, start: float, config: TrainConfig,
            loss: float | None, metrics: dict, best: dict, evaluated: bool) -> None:
    """A progress line; the held-out figures join its metrics when they were just measured
    (plotted once per evaluation, not repeated with every report)."""
    elapsed = time.perf_counter() - start
    left = elapsed / step * (total - step)
    if config.max_seconds is not None:
        left = min(left, max(0.0, config.max_seconds - elapsed))
    heldout = best["shown"]
    line = f"step {step}/{total}, loss {loss:.3f}" + (f"; held-out {heldout}" if heldout else "")
    figures = ({k: v for k, v in best["curve"][-1].items() if k != "step"}
               if evaluated and best["curve"] else {})
    progress(Progress("train", step, total, line, left, {"loss": loss, **metrics, **figures}))
