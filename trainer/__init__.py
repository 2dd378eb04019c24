"""Builds accelerators for the loaded model: self-distilled data, training, calibration."""
