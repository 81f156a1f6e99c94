"""Benchmarks: workloads, an OpenAI-compatible load client, and the side-by-side comparison (see compare.py)."""
