"""Quickdraft engine: loading, the decode loop, drafters and their verification."""
