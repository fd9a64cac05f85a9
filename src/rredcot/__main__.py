"""``python -m rredcot``: the same as the ``rredcot`` command."""

from rredcot.cli import main

raise SystemExit(main())
