"""``python -m rredcot``: the same as the ``rredcot`` command."""

from rredcot.cli.commands import main

raise SystemExit(main())
