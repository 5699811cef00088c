"""Compiled decoding loops and their pieces (sampling, stopping)."""
