"""Benchmarks: the benchmark GPT, the offline corpus, and one module per ``muonkit bench`` command."""
