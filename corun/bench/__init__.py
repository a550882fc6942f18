"""``corun bench``: the throughput suites (corun/bench/suite.py), one module per topic
they measure, each also a program of its own (``python -m corun.bench.<topic>``)."""
