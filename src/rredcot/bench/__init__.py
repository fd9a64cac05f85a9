"""Benchmarks: credit quality, learning, overhead."""
