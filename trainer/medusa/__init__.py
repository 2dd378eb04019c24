"""Medusa-1 heads: training on cached final states (train.py) and the choice of their tree
on this machine (calibrate.py). The pipeline calls check, reserve_s and train."""

from trainer.medusa.calibrate import CalibrationConfig
from trainer.medusa.train import MedusaTrainConfig, check, reserve_s, train

__all__ = ["CalibrationConfig", "MedusaTrainConfig", "check", "reserve_s", "train"]
