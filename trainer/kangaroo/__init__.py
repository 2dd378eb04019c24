"""The Kangaroo adapter: training per exit layer and what the pipeline and the train command
call (train_adapter.py: check, prep_seconds_per_token, reserve_s, train, summary_lines),
and the choice of exit layer, eta and gamma on this machine (calibrate_exit.py)."""
