"""Measuring one candidate: correctness gate, CUDA timing, the isolated worker process, the environment record."""
