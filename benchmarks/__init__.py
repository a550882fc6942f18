"""Throughput and overhead measurements; they print figures and never assert."""
