"""flexdemo's version: the one place it is written (``pyproject.toml`` reads it from here, and
``flexdemo.__version__`` re-exports it), importable without importing the package."""

__version__ = "0.1.0"
