"""A model loaded from a source (the bundled default, a folder, a GGUF file, a hub id) and
wrapped in its step target, and the chat model's own text embeddings. Imports the
foundation, decode, weights and lean.
"""
