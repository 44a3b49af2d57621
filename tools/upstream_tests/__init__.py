"""Helpers of tools/upstream-tests: the expected-failures files and verdicts (report), the pytest plugin."""
