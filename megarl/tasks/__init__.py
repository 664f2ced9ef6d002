"""Synthetic, verifiable tasks for the quickstart and tests."""
