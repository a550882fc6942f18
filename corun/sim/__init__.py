"""corun simulate: the real template on a mock clock, fitted to a run's figures."""
