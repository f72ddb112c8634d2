"""A quantised mean whose bytes stay flat in the group size: reduce-scatter, re-quantise,
all-gather.

A gathered quantised exchange (every rank decodes every rank's payload) sends ``(n - 1)``
payloads per rank, so its bytes grow with the group. Here the flat input is cut into ``n``
equal chunks (whole quantisation blocks); rank ``c`` *owns* chunk ``c``:

1. every rank encodes its ``n`` chunks and sends chunk ``c`` to its owner (one all-to-all);
2. each owner decodes the ``n`` encodings of its chunk, sums them in rank order, divides by
   ``n`` and encodes that mean again;
3. the owners' encoded means are all-gathered and every rank decodes all of them, its own
   included, so every replica ends with the same bits.

Per rank that is ``2 (n - 1) / n`` payloads sent (and received), at most two whatever the group
size, against ``n - 1`` for the gathered exchange; the price is a second rounding of the mean.
With owner error feedback (``FullReplicator(owner_error_feedback=...)``) each owner keeps what
that rounding lost for its chunk and adds it, decayed, to the next mean it encodes: the same
bytes, and every replica still decodes the same ones.

Every payload carries the 32-byte header of :mod:`.agreement`. An owner judges the ``n``
headers and decoded values of its chunk and sends its verdict on each sender (a flag per
sender, ahead of its encoded mean); every rank reads all verdicts in the gathered payloads and
raises the same error in the same step: non-finite input (:class:`NonFiniteGradientError`),
other parameters in use, or a corrupt payload naming the sender (:class:`CorruptPayloadError`).
A bad payload cannot be dropped here (owners would drop it from some chunks only): the
gathered exchange (``reduce="gather"``) offers ``on_bad_peer="drop"``.

With a bound on the peers' parts (:mod:`.bound`) an owner scales down a sender's part of its
chunk whose norm is over the bound (the multiple of the median of the ``n`` parts' norms, or
of its own part's with 2 ranks), and every rank scales down an owner's reduced chunk whose norm
is over the multiple of the norm of its own input there (a garbage mean from a hostile owner);
the norms ride in the reads of the device the exchange does anyway.
"""

from __future__ import annotations

import math

import torch

from ..compress.quant import ValueCodec
from ..transport import CommStats, Pending, all_gather, all_to_all_equal
from .agreement import (
    HEADER_BYTES,
    align8,
    check_flags,
    header_fault,
    header_problems,
    write_header,
)
from .bound import PeerBound, float_bits, from_bits

# an owner's verdict on one sender's chunk
OK, FLAGGED, OTHER_PARAMS, BAD_MAGIC, WRONG_STEP, NONFINITE = range(6)


class ScatterExchange:
    """The buffers and steps of one replicator's reduce-scatter exchange of ``total`` values
    over ``world`` ranks, encoded with ``codec`` (the all-to-all puts this rank's own chunk in
    place: no rank is needed)."""

    def __init__(self, codec: ValueCodec, total: int, world: int,
                 device: torch.device) -> None:
        self.codec, self.world = codec, world
        chunk, part, reply = self.sizes(total)
        # buffers for ``total`` values; :meth:`use` takes their fronts for fewer (a bucket)
        self._padded = torch.zeros(world * chunk, dtype=torch.float32, device=device)
        self._send = torch.zeros(world * part, dtype=torch.uint8, device=device)
        self._recv = torch.zeros(world * part, dtype=torch.uint8, device=device)
        self._mean = torch.zeros(reply, dtype=torch.uint8, device=device)
        self.verdict_at = HEADER_BYTES
        self.mean_at = HEADER_BYTES + 8 * world
        self.use(total)

    def sizes(self, total: int) -> tuple[int, int, int]:
        """(values per chunk: whole blocks, bytes of one chunk on the wire, bytes of an
        owner's mean) for an exchange of ``total`` values."""
        blocks = math.ceil(math.ceil(total / self.world) / self.codec.block)
        chunk = blocks * self.codec.block
        part = align8(HEADER_BYTES + self.codec.nbytes(chunk))
        reply = align8(HEADER_BYTES + 8 * self.world + self.codec.nbytes(chunk))
        return chunk, part, reply

    def use(self, total: int) -> None:
        """Exchange ``total`` values next (at most those it was built for): the fronts of
        its buffers, shaped for them."""
        self.total = total
        self.chunk, self.part, self.reply = self.sizes(total)
        n = self.world
        # the flat values, padded to n whole chunks (the layout lives in its front)
        self.padded = self._padded[: n * self.chunk]
        self.send = self._send[: n * self.part].view(n, self.part)
        self.recv = self._recv[: n * self.part].view(n, self.part)
        self.mean = self._mean[: self.reply]

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer it keeps (the views of :meth:`use` are of these)."""
        return [self._padded, self._send, self._recv, self._mean]

    @property
    def flat(self) -> torch.Tensor:
        """The input (and, after :meth:`finish`, the mean): ``total`` fp32 values."""
        return self.padded[: self.total]

    def payload_bytes(self) -> int:
        """Bytes this rank puts on the wire per exchange, over both rounds (its own chunk
        included): ``n`` chunks and one encoded mean."""
        return self.send.numel() + self.mean.numel()

    def exchange_bytes(self) -> int:
        """Bytes sent (and received) per rank: ``n - 1`` chunks, then ``n - 1`` means."""
        return (self.world - 1) * (self.part + self.reply)

    def start(self, step: int, flag: torch.Tensor, code: int, transport,
              stats: CommStats) -> Pending:
        """Encode the chunks of :attr:`flat` and launch the all-to-all (asynchronous)."""
        chunks = self.padded.view(self.world, self.chunk)
        self.padded[self.total:].zero_()
        for c in range(self.world):  # one encode per owner: n calls, whatever the model
            write_header(self.send[c], step, flag, code)
            self.codec.encode(chunks[c], self.send[c, HEADER_BYTES:])
        return all_to_all_equal(self.recv, self.send, transport, stats, async_op=True)

    def finish(self, pending: Pending, step: int, code: int, name: str, transport,
               stats: CommStats, bad_peer, owner_residual: torch.Tensor | None = None,
               owner_decay: float = 1.0, rank: int = 0,
               bound: PeerBound | None = None) -> None:
        """Complete the exchange: the owner's mean, its all-gather, the checks, and the
        decoded mean of every chunk in :attr:`flat`. ``bad_peer(r, step, reason)`` raises.
        ``rank``: this rank (the owner of chunk ``rank``); ``bound``: the bound on each
        sender's part of the owned chunk and on each owner's reduced chunk, or None.

        ``owner_residual`` (``chunk`` values of the chunk this rank, ``rank``, owns): error
        feedback of the owner's coding of the mean. The owner encodes ``owner_decay *
        owner_residual + mean`` instead of the mean and, once every check has passed, keeps
        what that coding lost (zero past the end of the values); a step that raises leaves
        it as it was. Not a byte more goes on the wire."""
        recv = pending.wait()
        n, size = self.world, self.chunk
        values = self.codec.decode(recv[:, HEADER_BYTES:], size)  # (n, chunk)
        heads = recv[:, :HEADER_BYTES].view(torch.int64)  # (n, 4)
        finite = torch.isfinite(values).all(1)
        words = [] if bound is None else [  # each sender's part's norm, this rank's input's
            float_bits(torch.linalg.vector_norm(values, dim=1)),
            float_bits(torch.linalg.vector_norm(self.padded.view(n, size), dim=1))]
        read = torch.cat([heads.reshape(-1), finite.to(torch.int64), *words]).tolist()
        verdict = self._judge([read[4 * r: 4 * r + 4] for r in range(n)], read[4 * n: 5 * n],
                              step, code)  # (1 host read)
        own = from_bits(read[6 * n:])  # this rank's input's norm on every chunk
        if bound is not None:  # the senders' parts of its chunk over the bound
            ok = [r for r in range(n) if verdict[r] == OK]
            for r, f in bound.judge(from_bits(read[5 * n: 6 * n]), ok, rank, step=step,
                                    transport=transport).items():
                values[r].mul_(f)
        total = values[0].clone()
        for r in range(1, n):  # rank order
            total.add_(values[r])
        total.div_(n)
        if owner_residual is not None:  # what earlier codings of this chunk's mean lost
            total.add_(owner_residual, alpha=owner_decay)
        write_header(self.mean, step, False, code)
        self.mean[self.verdict_at: self.mean_at].view(torch.int64).copy_(
            torch.tensor(verdict, dtype=torch.int64))
        self.codec.encode(total, self.mean[self.mean_at:])
        gathered = all_gather(self.mean, transport, stats)
        means = self.codec.decode(gathered[:, self.mean_at:], size)  # (n, chunk)
        ends = torch.isfinite(means).all(1).to(torch.int64)
        heads2 = gathered[:, :HEADER_BYTES].view(torch.int64)
        verdicts = gathered[:, self.verdict_at: self.mean_at].view(torch.int64)
        words = [] if bound is None else [float_bits(torch.linalg.vector_norm(means, dim=1))]
        read = torch.cat([heads2.reshape(-1), verdicts.reshape(-1), ends, *words]).tolist()
        self._raise_on_verdicts(read, step, code, name, transport, bad_peer)
        if owner_residual is not None:  # the step stands: keep what the coding lost
            torch.sub(total, means[rank], out=owner_residual)
            owner_residual[max(0, min(size, self.total - rank * size)):].zero_()  # padding
        if bound is not None:  # a reduced chunk over the multiple of this rank's part there
            for c, f in bound.own_limit(from_bits(read[5 * n + n * n:]), own, rank, step=step,
                                        transport=transport, what="reduced chunk").items():
                means[c].mul_(f)
        self.padded.view(n, size).copy_(means)

    def _judge(self, heads: list[list[int]], finite: list[int], step: int,
               code: int) -> list[int]:
        """An owner's verdict on each sender's chunk."""
        out = []
        for r, head in enumerate(heads):
            fault = header_fault(head, step)
            if fault is not None:
                out.append(BAD_MAGIC if fault == "magic" else WRONG_STEP)
            elif head[2]:
                out.append(FLAGGED)
            elif head[3] != code:
                out.append(OTHER_PARAMS)
            elif not finite[r]:
                out.append(NONFINITE)
            else:
                out.append(OK)
        return out

    def _raise_on_verdicts(self, read: list[int], step: int, code: int, name: str,
                           transport, bad_peer) -> None:
        """Every rank reads the same gathered bytes, so every rank raises alike."""
        n = self.world
        heads = [read[4 * c: 4 * c + 4] for c in range(n)]
        verdicts = [read[4 * n + n * c: 4 * n + n * c + n] for c in range(n)]
        ends = read[4 * n + n * n: 4 * n + n * n + n]
        for c, problem in enumerate(header_problems(heads, step)):  # an owner's own reply
            if problem is not None:
                bad_peer(c, step, f"its reduced chunk: {problem}")
        said = [{v[r] for v in verdicts} for r in range(n)]  # per sender, over owners
        for r, seen in enumerate(said):
            if BAD_MAGIC in seen or WRONG_STEP in seen:
                bad_peer(r, step, "bad magic/version" if BAD_MAGIC in seen else
                         "a payload for another step")
        flags = [int(FLAGGED in seen) for seen in said]
        present = [code + 1 if OTHER_PARAMS in seen else code for seen in said]
        check_flags(name, flags, present, code, step, transport)
        for r, seen in enumerate(said):
            if NONFINITE in seen:
                bad_peer(r, step, "non-finite value")
        for c in range(n):
            if not ends[c]:
                bad_peer(c, step, "its reduced chunk is non-finite")
