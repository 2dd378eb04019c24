"""Medusa-1 heads: training on cached final states and what the pipeline and the train
command call (train_heads.py: check, prep_seconds_per_token, reserve_s, train,
summary_lines), and the choice of their tree on this machine (calibrate_tree.py)."""
