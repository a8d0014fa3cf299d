"""Compatibility harness: Monarch 0.7.0's own public-API tests, run on actormesh and on Monarch.

Not part of the test suite (``testpaths = ["tests"]``); see bench/compat/README.md.
"""
