"""The speed report: prompts, the method table, the interleaved runner, the report and plots."""
