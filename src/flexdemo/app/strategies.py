"""The named strategies of ``flexdemo bench`` and ``flexdemo simulate``: the library's table,
:mod:`flexdemo.strategies` (public, shared with ``examples/train_gpt.py`` and the benchmarks)."""

from ..strategies import STRATEGIES, Strategy, check_strategy, parse_strategy

__all__ = ["STRATEGIES", "Strategy", "check_strategy", "parse_strategy"]
