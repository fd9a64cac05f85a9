"""The `rredcot` command line: one module per command."""

from rredcot.cli.commands import main

__all__ = ["main"]
