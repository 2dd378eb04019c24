"""The lean decode step for the Llama family (see engine/lean/target.py)."""
