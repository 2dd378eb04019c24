"""Medusa-1 heads: training on cached final states (train.py) and the choice of their tree
on this machine (calibrate.py). The pipeline calls check, prep_seconds_per_token,
reserve_s and train; the train command prints summary_lines."""

from trainer.medusa.calibrate import CalibrationConfig
from trainer.medusa.train import (
    MedusaTrainConfig,
    check,
    prep_seconds_per_token,
    reserve_s,
    summary_lines,
    train,
)

__all__ = [
    "CalibrationConfig",
    "MedusaTrainConfig",
    "check",
    "prep_seconds_per_token",
    "reserve_s",
    "summary_lines",
    "train",
]
