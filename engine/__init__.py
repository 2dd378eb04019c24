"""Quickdraft's engine: a model loaded, its replies decoded, drafted and verified.

Its own modules here are the foundation every folder shares (errors, paths, configs,
devices, progress reports, stored files, prompt files, the hub) and import none of its
folders. The folders, lowest first, each importing only the foundation and the folders
before it: datastore, decode, weights, lean, model, drafters (docs/architecture.md).
"""
