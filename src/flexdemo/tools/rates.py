"""Rates and times written the way tc writes them: ``"100mbit"``, ``"10mbps"``, ``"10ms"``."""

from __future__ import annotations

import math
import re

__all__ = ["MIN_RATE_BPS", "format_rate", "parse_bandwidth", "parse_latency"]

MIN_RATE_BPS = 10_000


_RATE_UNITS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}


_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0,
    "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6,
}


_NUMBER_UNIT = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_bandwidth(text: str | int | float) -> int:
    """Parse a tc-style rate (``"100mbit"``, ``"1gbit"``, ``"500kbit"``, ``"10mbps"``).

    Returns bits per second. ``bit`` units are bits per second, ``bps`` units are *bytes* per
    second (as in tc); ``k``/``m``/``g``/``t`` are powers of 1000, ``ki``/``mi``/... powers
    of 1024. An ``int`` or ``float`` is taken as bits per second. Raises ``ValueError``.
    """
    example = "write it like '100mbit', '1gbit', '500kbit' or '10mbps' (bytes/s)"
    if isinstance(text, bool):
        raise ValueError(f"bandwidth must be a rate string, got {text!r}; {example}")
    if isinstance(text, (int, float)):
        bps = float(text)
    elif isinstance(text, str):
        m = _NUMBER_UNIT.fullmatch(text)
        if not m:
            raise ValueError(f"bandwidth {text!r} is not a number followed by a unit; {example}")
        number, unit = m.group(1), m.group(2).lower()
        if not unit:
            raise ValueError(f"bandwidth {text!r} has no unit (bits or bytes per second?); "
                             f"{example}")
        if unit not in _RATE_UNITS:
            raise ValueError(f"bandwidth {text!r} has an unknown unit {m.group(2)!r} (known: "
                             f"{', '.join(_RATE_UNITS)}); {example}")
        bps = float(number) * _RATE_UNITS[unit]
    else:
        raise ValueError(f"bandwidth must be a rate string, got {type(text).__name__}; "
                         f"{example}")
    if not math.isfinite(bps) or bps <= 0:
        raise ValueError(f"bandwidth {text!r} must be a positive rate; {example}")
    if bps < MIN_RATE_BPS:
        raise ValueError(f"bandwidth {text!r} is below the minimum of 10kbit (one full packet "
                         f"would take over a second); {example}")
    return int(round(bps))


def parse_latency(text: str | float) -> float:
    """Parse a tc-style time (``"10ms"``, ``"500us"``, ``"0.1s"``); returns seconds.

    A ``float`` is taken as seconds. Must lie in (0, 10] seconds. Raises ``ValueError``.
    """
    example = "write it like '10ms', '500us' or '0.1s'"
    if isinstance(text, bool):
        raise ValueError(f"latency must be a time string, got {text!r}; {example}")
    if isinstance(text, (int, float)):
        seconds = float(text)
    elif isinstance(text, str):
        m = _NUMBER_UNIT.fullmatch(text)
        if not m:
            raise ValueError(f"latency {text!r} is not a number followed by a unit; {example}")
        unit = m.group(2).lower()
        if unit not in _TIME_UNITS:
            what = "has no unit" if not unit else f"has an unknown unit {m.group(2)!r}"
            raise ValueError(f"latency {text!r} {what}; {example}")
        seconds = float(m.group(1)) * _TIME_UNITS[unit]
    else:
        raise ValueError(f"latency must be a time string, got {type(text).__name__}; {example}")
    if not math.isfinite(seconds) or seconds <= 0 or seconds > 10:
        raise ValueError(f"latency {text!r} must be positive and at most 10s; {example}")
    return seconds


def format_rate(bps: float) -> str:
    """Human-readable rate: ``100 Mbit/s (12.5 MB/s)``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit} ({bps / 8e6:.4g} MB/s)"
    return f"{bps:.4g} bit/s ({bps / 8e6:.4g} MB/s)"
