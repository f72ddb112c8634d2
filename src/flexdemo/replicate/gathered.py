"""The mean of a dense exchange's gathered payloads: each peer's payload decoded, checked
(header, finite values) and bounded (:mod:`.bound`), summed in rank order, with one host
read (:class:`~flexdemo.replicate.full.FullReplicator`'s gathered path)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..compress import ValueCodec
from .agreement import HEADER_BYTES, check_flags, header_problems
from .bound import PeerBound, float_bits, from_bits

__all__ = ["mean_of_payloads"]


def mean_of_payloads(gathered: torch.Tensor, flat: torch.Tensor, step: int, code: int, *,
                     codec: ValueCodec, name: str, fmt: str,
                     bad_peer: Callable[[int, int, str], None], transport,
                     bound: PeerBound | None, rank: int) -> None:
    """Check the gathered payloads and write their mean into ``flat``, with one host read.

    Peers are decoded one at a time into one reused buffer (memory of one payload,
    whatever the group size) and summed in rank order; the least and largest value of
    each tells whether it is finite, and (``peer_bound``) its norm whether it is within
    the bound. The headers, those ends and norms are read once at the end, and a bad
    peer raises or is left out, a peer over the bound is scaled down: then (the
    rare path) the sum is taken again over the peers kept, the same bits as if the bad
    one had never been added. ``fmt``: the value format (``codec``'s), named in a hint."""
    n, total = gathered.shape[0], flat.numel()
    heads = gathered[:, :HEADER_BYTES].view(torch.int64)  # (n, 4)
    scratch = codec.workspace(codec.room(total), flat.device)  # (encoded)
    ends: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    flat.zero_()
    for r in range(n):  # rank order: every replica sums alike
        values = codec.decode_into(gathered[r, HEADER_BYTES:], total, scratch)
        ends.extend(torch.aminmax(values))
        if bound is not None:
            norms.append(torch.linalg.vector_norm(values))
        flat.add_(values)
    finite = torch.isfinite(torch.stack(ends).view(n, 2)).all(1)
    words = [float_bits(torch.stack(norms))] if norms else []
    read = torch.cat([heads.reshape(-1), finite.to(torch.int64), *words]).tolist()
    heads_l = [read[4 * r: 4 * r + 4] for r in range(n)]
    problems = header_problems(heads_l, step)
    peers = [r for r in range(n) if problems[r] is None]
    for r, problem in enumerate(problems):
        if problem is not None:
            bad_peer(r, step, problem)
    check_flags(name, [heads_l[r][2] if r in peers else 0 for r in range(n)],
                [heads_l[r][3] if r in peers else code for r in range(n)], code, step,
                transport)
    good = [r for r in peers if read[4 * n + r]]
    for r in peers:
        if r not in good:
            hint = " (fp16 overflows beyond 65504: use values='bf16')" \
                if fmt == "fp16" else ""
            bad_peer(r, step, f"non-finite value{hint}")
    clip = {} if bound is None else bound.judge(
        from_bits(read[5 * n:]), good, rank, step=step, transport=transport)
    if len(good) < n or clip:  # dropped or clipped peers: the sum again, of the good ones
        flat.zero_()
        for r in good:
            values = codec.decode_into(gathered[r, HEADER_BYTES:], total, scratch)
            flat.add_(values if r not in clip else values.mul_(clip[r]))
    if good:
        flat.div_(len(good))
