"""``corun bench``: the throughput suites (benchmarks/suite.py), one module per topic
they measure, each also a program of its own (``python -m benchmarks.<topic>``)."""
