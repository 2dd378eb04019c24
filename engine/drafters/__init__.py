"""Drafters: what proposes tokens for the shared decode loop to verify."""
