"""Benchmarks run from the command line (`python -m benchmarks.memory`) and imported by chapter plots."""
