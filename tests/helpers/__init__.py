"""Shared test helpers: tiny targets and checkpoints, corpora, statistics, a test-only family."""
