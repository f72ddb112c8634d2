"""The replicate group's link: a bounded probe of its bandwidth and latency.

:func:`probe_link` runs a fixed sequence of all-reduces over the group: three of 16 bytes (the
latency: one collective's time, which includes the ring's hops for this group size), then
buffers of 64 KiB, 256 KiB, 1 MiB and 4 MiB (the bandwidth: bytes one rank sends, by the ring
formula of :mod:`flexdemo.transport`, over the time of the largest buffer that finished; its
latency is not taken off, which errs on the slow side and keeps a noisy latency from making
the bandwidth absurd). It waits at most ``seconds`` in all. After each buffer of the bandwidth
phase the ranks vote in a 4-byte all-reduce whether to go on: a rank votes to stop when it
gave up waiting, or when the next buffer, four times as large, would not finish in time at the
rate it just measured; one vote to stop stops every rank. So on a slow link the probe ends
with the largest buffer that fits (at 10 Mbit/s, 1 MiB) rather than leaving a 4 MiB one to
finish in the background, and the sequences of collectives stay paired on every rank: a late
peer never meets a collective that is not there. A rank that gave up still issues what its
peers will issue (the buffer and the vote), without waiting; what is in flight finishes in the
background. A probe that ends before any buffer finished reports ``timed_out`` and the caller
falls back (:data:`FALLBACK_LINK`).

Ranks measure on their own; :mod:`flexdemo.auto.replicator` makes them agree (the slowest
bandwidth, the largest latency, any time-out) before anything is decided.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

import torch

from ..transport import Transport, all_reduce_bytes

__all__ = ["FALLBACK_LINK", "PROBE_BYTES", "Link", "parse_link", "probe_link"]

#: buffer sizes of the probe's all-reduces (bytes): three for the latency, then growing
PROBE_BYTES = (16, 16, 16, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


@dataclass(frozen=True)
class Link:
    """A link between replicas: ``bandwidth`` in bytes per second that one rank sends,
    ``latency`` in seconds per collective, ``source`` (``"probe"``, ``"given"``,
    ``"fallback"``) and, for a probe, its ``seconds`` and whether it ``timed_out``."""

    bandwidth: float
    latency: float
    source: str = "given"
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def mbit(self) -> float:
        """The bandwidth in Mbit/s."""
        return self.bandwidth * 8 / 1e6

    def seconds_for(self, nbytes: float, collectives: int = 1) -> float:
        """Seconds to send ``nbytes`` (per rank) in ``collectives`` collectives."""
        return collectives * self.latency + nbytes / self.bandwidth

    def describe(self) -> str:
        """``97 Mbit/s, 0.4 ms`` (bandwidth and latency, rounded for a log line)."""
        return f"{_number(self.mbit)} Mbit/s, {_number(self.latency * 1e3)} ms"

    def as_dict(self) -> dict:
        return asdict(self)


#: what a probe that timed out (or a group it cannot probe) assumes: a slow link, so that the
#: choice spends few bytes
FALLBACK_LINK = Link(bandwidth=10e6 / 8, latency=0.05, source="fallback")


def _number(x: float) -> str:
    """Three significant digits at most, no exponent for everyday sizes."""
    return f"{x:.0f}" if x >= 100 else f"{x:.2g}"


_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
          "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9}


def parse_link(spec: str | dict | Link) -> Link:
    """A :class:`Link` from ``"100mbit,1ms"`` (also ``"1gbit"``, ``"12MB,0.5ms"``: rates per
    second, bits or bytes; latency in ``ms``, ``us`` or ``s``, default 1 ms), a dict with
    ``bandwidth`` (bytes/s) and ``latency`` (s), or a Link. Raises ``ValueError`` in one line."""
    if isinstance(spec, Link):
        return spec
    if isinstance(spec, dict):
        try:
            return Link(float(spec["bandwidth"]), float(spec.get("latency", 1e-3)))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a link is a dict with 'bandwidth' (bytes/s) and 'latency' (s), "
                             f"got {spec!r}") from None
    text = str(spec).strip().lower().replace(" ", "")
    rate, _, lat = text.partition(",")
    m = re.fullmatch(r"([0-9.]+(?:e-?[0-9]+)?)(bit|kbit|mbit|gbit|b|kb|mb|gb)(?:/s|ps)?", rate)
    n = re.fullmatch(r"([0-9.]+(?:e-?[0-9]+)?)(ms|us|s)", lat) if lat else None
    if m is None or (lat and n is None):
        raise ValueError(f"link {spec!r}: write a rate and a latency, e.g. '100mbit,1ms' or "
                         "'1gbit,0.2ms'")
    bandwidth = float(m.group(1)) * _UNITS[m.group(2)]
    latency = 1e-3 if n is None else float(n.group(1)) * {"ms": 1e-3, "us": 1e-6, "s": 1.0}[
        n.group(2)]
    if not bandwidth > 0 or latency < 0:
        raise ValueError(f"link {spec!r}: the rate must be positive, the latency >= 0")
    return Link(bandwidth, latency)


def _wait(work, deadline: float) -> bool:
    """Wait for ``work`` until ``deadline`` (``time.perf_counter()``); whether it finished."""
    if work is None:
        return True
    left = deadline - time.perf_counter()
    if left <= 0:
        return False
    try:
        work.wait(timedelta(seconds=left))
    except TypeError:  # a handle without a timeout (in-process: already finished)
        work.wait()
    except RuntimeError:  # gloo: "Operation timed out!"; the work goes on in the background
        return False
    return True


def probe_link(group: Transport, seconds: float = 2.0, sizes: tuple[int, ...] = PROBE_BYTES,
               device: torch.device | str = "cpu") -> tuple[Link, list]:
    """Measure ``group``'s link within ``seconds`` (see the module). Returns the link and the
    collectives still in flight (keep them referenced until they finish: their buffers are
    in use); a probe with nothing measured gives :data:`FALLBACK_LINK` with ``timed_out``.
    ``device``: where the buffers live (the group's backend must reach it)."""
    n = group.size
    t0 = time.perf_counter()
    deadline = t0 + seconds
    late = False
    inflight: list = []
    times: list[tuple[int, float]] = []
    for i, size in enumerate(sizes):
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        start = time.perf_counter()
        work = group.all_reduce_sum_(buf, async_op=True)
        if late or not _wait(work, deadline):
            late = True
            inflight.append((work, buf))
        else:
            times.append((buf.numel(), time.perf_counter() - start))
        if size <= 64 or i + 1 == len(sizes):
            continue
        # the next buffer only if every rank expects it to finish in time (one vote: a 4-byte
        # all-reduce that every rank issues after each buffer of the bandwidth phase)
        next_t = times[-1][1] * sizes[i + 1] / size if not late else math.inf
        stop = late or time.perf_counter() + next_t > deadline
        vote = torch.tensor([1.0 if stop else 0.0], device=device)
        vwork = group.all_reduce_sum_(vote, async_op=True)
        if stop:  # the sum is > 0 whatever the peers said: no need to wait for it
            inflight.append((vwork, vote))
            break
        if not _wait(vwork, max(deadline, time.perf_counter() + 1.0)):
            inflight.append((vwork, vote))  # a peer is gone: what follows will say so
            break
        if float(vote[0]) > 0:
            break
    took = time.perf_counter() - t0
    small = sorted(t for numel, t in times if numel * 4 <= 64)
    big = [(numel, t) for numel, t in times if numel * 4 > 64]
    if not small or not big:
        return replace(FALLBACK_LINK, seconds=took, timed_out=True), inflight
    latency = small[len(small) // 2]
    numel, t = big[-1]
    bandwidth = all_reduce_bytes(numel, 4, n) / t  # its latency included: on the safe side
    return Link(bandwidth, latency, "probe", took), inflight
