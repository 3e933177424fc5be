"""``python -m flashot.cli``: the ``flashot`` command."""

import sys

from . import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
