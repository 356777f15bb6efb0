"""``python -m edgekit ...``: the ``edgekit`` command where the console script is not on PATH."""

import sys

from edgekit.cli import main

if __name__ == "__main__":
    sys.exit(main())
