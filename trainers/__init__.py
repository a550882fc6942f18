"""Concrete trainers built on corun's public API: models, algorithms and tasks."""
