"""Quickdraft's front ends: the command line and the Gradio app."""
