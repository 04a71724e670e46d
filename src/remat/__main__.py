"""``python -m remat``: the ``remat`` command line."""

from .cli import main

raise SystemExit(main())
