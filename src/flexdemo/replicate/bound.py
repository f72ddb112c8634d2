"""Bounded contributions: no one peer's part of an exchange may outweigh the others by more
than a multiple (``peer_bound``, default :data:`PEER_BOUND`).

Where a replica combines its peers' data it knows each peer's part and can take its norm,
and compare it with a *base*:

* with 3 or more parts, the median of their norms (the same on every replica of a gathered
  exchange: every replica decodes the same bytes);
* with 2, the norm of the receiver's own part (the median of two is their mean, which the
  larger one drives);
* a zero base (nothing to compare with) clips nothing.

A part whose norm is over the bound, ``peer_bound`` times its base, is taken for an outlier
and scaled down to the base before it is added: it then weighs as much as a typical part
(the median clip of SparseLoCo's production code), not ``peer_bound`` times more. The loose
bound only decides when.

Honest peers stay far from the bound (docs/replicators.md gives the ratios measured), so an
honest run clips nothing and keeps the bits it had without the bound: the norms ride in the
read of the verdict the exchange does anyway, the decision is made there on the host, and only
a part over the bound is scaled (the rare path sums again). Where a step reads nothing before
it combines (DeMo's delayed mode, a DeMo block owner) the factors are computed on the device,
1 for a part within the bound (multiplying by 1 keeps the bits), and read with the verdict.

A quantised payload's scales need no bound of their own: a non-finite scale decodes to
non-finite values, which the payload checks catch, and a finite one, however large, is what
the norm of the decoded values measures.

Each clip is counted (:attr:`PeerBound.clipped`,
``last_step_stats()["clipped_contributions"]``) and the first is named in one line on stderr.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Callable, Sequence

import torch

from .agreement import global_rank_of

#: the default multiple: honest peers measured at most 2.54x the median, 1.43x the receiver's
#: own norm and 1.68x its own part of a reduced chunk (docs/replicators.md, "Bounded
#: contributions"): about 3x of margin
PEER_BOUND = 8.0

STATS_KEY = "clipped_contributions"


def check_peer_bound(value) -> float | None:
    """``peer_bound`` checked: None or False (off), or a finite number > 1."""
    if value is None or value is False:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 1.0):
        raise ValueError(f"peer_bound must be None or False (off) or a number > 1 (the "
                         f"multiple of the median of the peers' norms, or with 2 replicas of "
                         f"the receiver's own norm, that one peer's part may reach), got "
                         f"{value!r}")
    return float(value)


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """Float values as int64 words (their fp64 bits), to ride in an int64 read of the
    device; :func:`from_bits` reads them back exactly."""
    return t.to(torch.float64).view(torch.int64).reshape(-1)


def from_bits(words: Sequence[int]) -> list[float]:
    """The floats of :func:`float_bits`' words (read into Python ints), on the host."""
    return list(struct.unpack(f"{len(words)}d", struct.pack(f"{len(words)}q", *words)))


def median(values: Sequence[float]) -> float:
    """The median, the mean of the two middle values for an even count."""
    s = sorted(values)
    k = len(s)
    return (s[(k - 1) // 2] + s[k // 2]) / 2


class PeerBound:
    """One replicator's bound on each peer's part (``multiple``: ``peer_bound``, None: off),
    its count of clipped parts and its one line on stderr.

    A part's *base* is the median of the parts' norms (3 or more parts) or this replica's own
    part's norm (2); the bound is ``multiple`` times the base, and a part over it is scaled
    down to the base."""

    def __init__(self, multiple: float | None, name: str) -> None:
        self.multiple, self.name = multiple, name
        self.clipped = 0  # parts clipped so far on this replica
        self.said = False

    @property
    def on(self) -> bool:
        return self.multiple is not None

    def base(self, norms: Sequence[float], peers: Sequence[int], own: int) -> float | None:
        """The base of the parts of ``peers`` (norms indexed by peer) seen by ``own``; None
        when there is nothing to compare with (fewer than 2 parts, a zero base)."""
        if self.multiple is None or len(peers) < 2:
            return None
        if len(peers) >= 3:
            base = median([norms[r] for r in peers])
        elif own in peers:
            base = norms[own]
        else:
            return None
        return base if base > 0.0 and math.isfinite(base) else None

    def words(self, peers: int) -> str:
        """The base in words, for a part among ``peers``."""
        if peers >= 3:
            return f"the median of {peers} peers' norms"
        return "this replica's own norm"

    def judge(self, norms: Sequence[float], peers: Sequence[int], own: int, *, step: int,
              transport, what: str = "contribution") -> dict[int, float]:
        """The factor of each peer of ``peers`` whose norm is over the bound (down to the
        base; the rest are left as they are); counts them and names the first on stderr."""
        base = self.base(norms, peers, own)
        if base is None:
            return {}
        out = {r: base / norms[r] for r in peers if norms[r] > self._bound(base)}
        for r in out:
            self._clip(r, norms[r], base, self.words(len(peers)), step, transport, what)
        return out

    def read_verdict(self, verdict: torch.Tensor, norms: torch.Tensor,
                     good_of: Callable[[list[list[int]]], list[int]], own: int, *, step: int,
                     transport) -> tuple[list[int], torch.Tensor | None]:
        """A verdict ``(peers, w)`` and the peers' ``norms`` read in one host read:
        ``(good peers, by good_of(rows)), each peer's factor (peers,) where one is over the
        bound, else None)``."""
        n, w = verdict.shape
        read = torch.cat([verdict.reshape(-1), float_bits(norms)]).tolist()  # the one read
        good = good_of([read[w * r: w * r + w] for r in range(n)])
        clip = self.judge(from_bits(read[w * n:]), good, own, step=step, transport=transport)
        factors = None if not clip else torch.tensor(
            [clip.get(r, 1.0) for r in range(n)], dtype=torch.float32, device=verdict.device)
        return good, factors

    def own_limit(self, norms: Sequence[float], own: Sequence[float], skip: int, *,
                  step: int, transport, what: str) -> dict[int, float]:
        """The factor of each part ``c`` (not ``skip``) whose norm ``norms[c]`` is over the
        bound on this replica's own part there, ``own[c]`` (a reduced chunk: its base is what
        this replica sent into it); counts them and names the first."""
        out: dict[int, float] = {}
        if self.multiple is None:
            return out
        for c, (norm, base) in enumerate(zip(norms, own)):
            if c != skip and base > 0.0 and math.isfinite(base) and norm > self._bound(base):
                out[c] = base / norm
                self._clip(c, norm, base, "this replica's own part's norm there", step,
                           transport, what)
        return out

    def report(self, norms: Sequence[float], factors: Sequence[float], peers: int, *,
               step: int, transport, what: str = "contribution") -> None:
        """Count and (the first) name the parts that the device clipped (``factors`` below 1,
        :meth:`factors_on_device`), read with the verdict they rode in."""
        for r, (norm, f) in enumerate(zip(norms, factors)):
            if f < 1.0:
                self._clip(r, norm, norm * f, self.words(peers), step, transport, what)

    def _bound(self, base: float) -> float:
        assert self.multiple is not None
        return self.multiple * base

    def _clip(self, r: int, norm: float, base: float, words: str, step: int, transport,
              what: str) -> None:
        """Count a clipped part; the first, in one line on stderr."""
        self.clipped += 1
        if self.said:
            return
        self.said = True
        g = global_rank_of(transport, r)
        who = f"replica {r}" + (f" (rank {g})" if g != r else "")
        ratio = norm / self._bound(base)
        print(f"flexdemo: {self.name}: {who}'s {what} had norm {norm:.2g} at step {step}, "
              f"{ratio:.3g}x over the bound ({self.multiple:g} x {words}): scaled down to "
              f"{words} ({base:.2g}); further clips are counted in "
              f"last_step_stats()[{STATS_KEY!r}]", file=sys.stderr, flush=True)

    def factors_on_device(self, norms: torch.Tensor, own: int,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
        """The factor of every part (1 where it is within the bound: multiplying by it keeps
        the bits), decided on the device from ``norms`` ``(parts,)`` over the parts ``keep``
        (default all), ``own`` this replica's part; no read of the device (the caller reads
        the factors with its verdict and :meth:`report` s them)."""
        m = self.multiple
        assert m is not None, "the bound is on"
        n = norms.shape[0]
        if keep is None:
            keep = torch.ones(n, dtype=torch.bool, device=norms.device)
        srt = torch.where(keep, norms, torch.inf).sort().values
        count = keep.sum()
        middle = torch.stack([(count - 1) // 2, count // 2]).clamp(min=0, max=n - 1)
        med = srt.gather(0, middle).mean()
        base = torch.where(count >= 3, med,
                           torch.where(keep[own] & (count == 2), norms[own], 0.0))
        over = keep & (base > 0) & torch.isfinite(base) & (norms > base * m)
        return torch.where(over, base / norms, 1.0)
