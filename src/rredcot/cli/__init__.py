"""The `rredcot` command line: one module per command."""

from rredcot.cli.main import main

__all__ = ["main"]
