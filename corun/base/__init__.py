"""The vocabulary every layer shares: errors, the config schema, seeds, the time base."""
