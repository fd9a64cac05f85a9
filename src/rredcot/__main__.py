"""``python -m rredcot``: the same as the ``rredcot`` command."""

from rredcot.cli.main import main

raise SystemExit(main())
