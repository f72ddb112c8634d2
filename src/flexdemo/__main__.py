"""``python -m flexdemo ...``: the flexdemo command line."""

from .app.cli import entry

if __name__ == "__main__":
    entry()
