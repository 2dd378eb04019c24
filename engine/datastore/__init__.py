"""The datastore of the model's own replies: its memory in two tiers, the suffix index and
the longest match, its snapshot and log on disk, and opening it. Imports the foundation
only.
"""
