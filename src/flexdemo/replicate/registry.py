"""The replicators by name: one dict, filled by :mod:`flexdemo.replicate` (kept apart so that
replicators which resolve other replicators by name, like DiLoCo's exchange, import it
without an import circle). Register a new one with ``REPLICATORS["name"] = factory``."""

from collections.abc import Callable

from .base import Replicator

REPLICATORS: dict[str, Callable[..., Replicator]] = {}
