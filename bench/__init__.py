"""Benchmarks: one script per question, printing ratios measured in one run."""
