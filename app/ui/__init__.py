"""The Gradio page: one module per tab, the layout that joins them, and the launcher."""
