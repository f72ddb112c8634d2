"""``python -m flexdemo ...``: the flexdemo command line."""

import sys

from .app.cli import main

if __name__ == "__main__":
    sys.exit(main())
