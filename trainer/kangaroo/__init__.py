"""The Kangaroo adapter: training per exit layer (train.py) and the choice of exit layer,
eta and gamma on this machine (calibrate.py). The pipeline calls check,
prep_seconds_per_token, reserve_s and train; the train command prints summary_lines."""

from trainer.kangaroo.calibrate import KangarooCalibration
from trainer.kangaroo.train import (
    KangarooTrainConfig,
    check,
    prep_seconds_per_token,
    reserve_s,
    summary_lines,
    train,
)

__all__ = [
    "KangarooCalibration",
    "KangarooTrainConfig",
    "check",
    "prep_seconds_per_token",
    "reserve_s",
    "summary_lines",
    "train",
]
