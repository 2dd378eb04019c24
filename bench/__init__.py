"""The speed report: prompts, the method table, the interleaved runner, the report and
plots. Outside the engine it measures; imports the engine only.
"""
