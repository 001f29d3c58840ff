"""Benchmarks that run tmrun, torchrun and torchft side by side; see docs/benchmarks.md."""
