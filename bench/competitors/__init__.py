"""Competitors for the side-by-side failure benchmarks: the same GPT training run under other
fault-tolerance systems (torchft, ...), each writing the common JSON-lines step log."""
