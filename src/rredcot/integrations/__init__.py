"""Thin adapters to TRL and verl."""
