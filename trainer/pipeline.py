"""Build an accelerator end to end: self-distilled data -> features -> training ->
calibration -> checkpoint, within one time budget, resumable after a kill (the data file
resumes and the feature cache is reused)."""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.drafters.accelerators import save_checkpoint
from engine.drafters.registry import TRAINED, method
from engine.errors import QuickdraftError
from engine.progress import Progress, ProgressFn, ignore
from trainer.features import conversation_tokens
from trainer.kangaroo.calibrate_exit import KangarooCalibration
from trainer.kangaroo.train_adapter import KangarooTrainConfig
from trainer.medusa.calibrate_tree import CalibrationConfig
from trainer.medusa.train_heads import MedusaTrainConfig
from trainer.resume import Resume, load_resume
from trainer.sampler import supports_rows
from trainer.seeds import DataBudget
from trainer.selfdistill import data_path, generate_data, split_heldout
from trainer.training_loop import TrainConfig

# (train, held-out) conversations a run collects even past its data share: the least a
# budget as small as the page offers still trains and measures on
LEAST_DATA = (24, 4)


@dataclass(frozen=True)
class TrainOptions:
    """What to build and how long it may take."""

    method: str  # "medusa" | "kangaroo"
    max_minutes: float = 20.0  # whole job, data generation included; the method's trainer
    # receives a copy whose max_minutes is the time left after data generation
    prompts_file: Path | None = None  # the user's extra seed prompts (JSONL or plain text)
    prep_share: float = 0.65  # fraction of the budget for the data and for reading its
    # features: the data stage stops when its time plus the features' timed cost of what it
    # wrote (and of the chats) reaches it; the rest trains and calibrates
    heldout_fraction: float = 0.06  # seed prompts kept out of training for held-out figures
    calibration_seconds: float = 90.0  # time Medusa keeps back for calibration after
    # training (Kangaroo's is options.kangaroo.calibration.seconds)
    data: DataBudget = field(default_factory=DataBudget)  # sampling (its time set by the share)
    medusa: MedusaTrainConfig = field(default_factory=MedusaTrainConfig)  # Medusa heads and loss
    kangaroo: KangarooTrainConfig = field(default_factory=KangarooTrainConfig)  # exits, sweep
    train: TrainConfig = field(default_factory=TrainConfig)  # optimiser and schedule
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)  # tree search
    # the user's own chats with this model as {"role", "content"} lists (app/ reads them from
    # its store): merged into the training split only, so held-out figures stay comparable
    chats: tuple[list[dict], ...] = ()
    continue_training: bool = False  # start from the stored accelerator (Retrain, --continue)
    resume: Resume | None = None  # what train_accelerator loaded for continue_training; the
    # method's trainer reads it through trainer.resume.start_from (callers leave it None)

    def __post_init__(self) -> None:
        if self.method not in TRAINED:
            raise QuickdraftError(f"unknown method {self.method!r}: choose one of "
                                  f"{', '.join(TRAINED)}")
        if not self.max_minutes > 0:
            raise QuickdraftError("--max-minutes must be a positive number")
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise QuickdraftError(f"prompts file not found: {self.prompts_file}")


def options_for(method: str, max_minutes: float, prompts_file: Path | None = None,
                chats: tuple[list[dict], ...] = (), continue_training: bool = False
                ) -> TrainOptions:
    """Default options whose calibration reserves fit the budget: short runs keep at most
    15% of their time for calibration instead of the full reserve."""
    cap = max_minutes * 60 * 0.15
    kangaroo = KangarooTrainConfig(calibration=KangarooCalibration(
        seconds=min(KangarooCalibration.seconds, cap)))
    return TrainOptions(method=method, max_minutes=max_minutes, prompts_file=prompts_file,
                        calibration_seconds=min(TrainOptions.calibration_seconds, cap),
                        kangaroo=kangaroo, chats=tuple(chats),
                        continue_training=continue_training)


@dataclass
class TrainResult:
    """What a finished (or cancelled) run produced."""

    method: str
    folder: Path | None  # the saved checkpoint; None when cancelled before saving
    settings: dict  # drafter.json settings
    metrics: dict  # metrics.json (per-stage times included)
    data: dict  # data summary: conversations, tokens, seconds
    cancelled: bool = False


def train_accelerator(lm, options: TrainOptions, progress: ProgressFn = ignore,
                      cancel: threading.Event | None = None) -> TrainResult:
    """Run every stage for `options.method` and save the checkpoint for `lm`."""
    trainer = importlib.import_module(method(options.method).trainer)
    trainer.check(lm)  # refuse before spending the data budget
    start = time.perf_counter()
    total_s = options.max_minutes * 60
    report = _with_eta(progress, start, total_s, trainer.reserve_s(options))
    resume = _resume(lm, options, report)
    budget = _data_budget(lm, trainer, options, total_s)
    prompt_files = [Path(options.prompts_file)] if options.prompts_file else None
    data = generate_data(lm, data_path(lm), prompt_files, budget, report, cancel)
    if _cancelled(cancel):
        return TrainResult(options.method, None, {}, {}, data, cancelled=True)
    train_convs, heldout_convs = split_heldout(data_path(lm), options.heldout_fraction)
    train_convs += list(options.chats)  # never held out: held-out figures stay comparable
    if options.chats:
        report(Progress("data", 1, 1, f"{len(options.chats)} conversations from your chats"))
    if len(train_convs) < 2 or not heldout_convs:
        raise QuickdraftError(f"too little training data ({len(train_convs)} conversations, "
                              f"{len(heldout_convs)} held out): "
                              "give training more time with --max-minutes")
    left_min = max(1.0, total_s - (time.perf_counter() - start)) / 60
    stage_options = dataclasses.replace(options, max_minutes=left_min, resume=resume)
    try:
        tensors, settings, metrics = trainer.train(
            lm, train_convs, heldout_convs, stage_options, report, cancel)
    except QuickdraftError:
        if not _cancelled(cancel):
            raise
        tensors, settings, metrics = {}, {}, {}  # a stage stopped at the cancel
    if _cancelled(cancel):
        return TrainResult(options.method, None, settings, metrics, data, cancelled=True)
    metrics.setdefault("times", {})["data_s"] = data["seconds"]
    metrics["times"]["total_s"] = round(time.perf_counter() - start, 1)
    metrics["chat_conversations"] = len(options.chats)
    if resume is not None:
        metrics["continued"] = {"from": str(resume.folder), "modules": resume.outcomes}
    summary = {
        **data,
        "train_conversations": len(train_convs),
        "heldout_conversations": len(heldout_convs),
        "chat_conversations": len(options.chats),
        "continued": resume is not None and resume.continued > 0,
    }
    report(Progress("save", 0, 1, "saving the checkpoint"))
    folder = save_checkpoint(lm, options.method, tensors, settings, metrics, summary)
    report(Progress("done", 1, 1, f"saved to {folder}", 0.0))
    return TrainResult(options.method, folder, settings, metrics, summary)


def _data_budget(lm, trainer, options: TrainOptions, total_s: float) -> DataBudget:
    """The data stage's share, net of the features the chats will cost, with the per-token
    cost of the features it will add (timed here: a model 4x bigger reads its data 4x
    slower, and a budget that ignored it would leave training no time). Answers written on
    the lean step's batched rows come with their features (trainer/recorded.py): those
    cost the features stage nothing."""
    per_token = trainer.prep_seconds_per_token(lm, options)
    chats_s = per_token * sum(conversation_tokens(lm, chat) for chat in options.chats)
    share = max(0.0, total_s * options.prep_share - chats_s)
    records = supports_rows(lm)
    return dataclasses.replace(options.data, max_seconds=share, least=LEAST_DATA,
                               heldout_fraction=options.heldout_fraction,
                               prep_s_per_token=0.0 if records else per_token,
                               record_layers=trainer.feature_layers(lm, options) if records else ())


def _resume(lm, options: TrainOptions, report: ProgressFn) -> Resume | None:
    """The stored checkpoint to continue from, when asked; None (with a notice saying why)
    when there is none that fits: the run then trains from scratch."""
    if not options.continue_training:
        return None
    resume, notice = load_resume(lm, options.method)
    report(Progress("data", 0, 1, notice or f"continuing from {resume.folder}"))
    return resume


def _cancelled(cancel: threading.Event | None) -> bool:
    return cancel is not None and cancel.is_set()


def _with_eta(progress: ProgressFn, start: float, total_s: float,
              calibration_s: float) -> ProgressFn:
    """The job's ETA: training fills the budget, so until it runs the ETA is the time left in
    the budget; from then on the stage's own ETA (plus calibration while training)."""

    def report(p: Progress) -> None:
        left = max(0.0, total_s - (time.perf_counter() - start))
        if p.stage in ("data", "features") or p.eta_s is None:
            p.eta_s = left if p.stage != "done" else 0.0
        else:
            p.eta_s = min(left, p.eta_s + (calibration_s if p.stage == "train" else 0.0))
        progress(p)

    return report
