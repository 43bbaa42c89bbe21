"""``python -m gnncompile``: the command line (:mod:`gnncompile.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":  # not when a process that starts ranks re-imports the main module
    sys.exit(main())
