"""The lean decode step for the Llama family (see engine/lean/lean_target.py). Imports the
foundation, decode and weights.
"""
