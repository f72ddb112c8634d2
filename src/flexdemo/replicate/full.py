"""Dense replicators: Full (average the gradient) and NoReplication."""

from __future__ import annotations

import torch

from ..compress.quant import ValueCodec
from ..memory import ReleasableStorages
from ..transport import all_gather, all_reduce_bytes, all_reduce_sum
from .agreement import (
    HEADER_BYTES,
    Agreement,
    NonFiniteGradientError,
    align8,
    global_rank_of,
    nonfinite_flag,
    write_header,
)
from .base import Replicator
from .bound import PEER_BOUND, PeerBound, check_peer_bound
from .buckets import FlatBuckets, check_bucket_numel, resolve_bucket_numel
from .demo.settings import RARE_BUCKETS
from .gathered import mean_of_payloads
from .scatter import ScatterExchange
from .weights import TokenWeighted


class FlatLayout:
    """Tensors of fixed shapes laid end to end in one flat fp32 buffer.

    Views of every tensor are built once; :meth:`plan` gives, per pattern of missing
    gradients, the views of the present and of the missing tensors, so that filling the
    buffer and writing results back are one batched op each, whatever the number of tensors.
    """

    def __init__(self, shapes: list[torch.Size], device: torch.device,
                 flat: torch.Tensor | None = None) -> None:
        self.sizes = [s.numel() for s in shapes]
        self.total = sum(self.sizes)
        if flat is None:
            flat = torch.zeros(self.total, dtype=torch.float32, device=device)
        self.flat = flat
        self.views, off = [], 0
        for shape, size in zip(shapes, self.sizes):
            self.views.append(self.flat[off: off + size].view(shape))
            off += size
        self._plans: dict[tuple, tuple] = {}

    def plan(self, grads: list) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """(indices of present tensors, their views, the views of the missing ones)."""
        key = tuple(g is None for g in grads)
        plan = self._plans.get(key)
        if plan is None:
            present = [i for i, g in enumerate(grads) if g is not None]
            missing = [self.views[i] for i, g in enumerate(grads) if g is None]
            plan = self._plans[key] = (present, [self.views[i] for i in present], missing)
        return plan

    def fill(self, grads: list) -> list[torch.Tensor]:
        """Copy ``grads`` into the buffer (zeros for missing ones); returns the present ones."""
        present, views, missing = self.plan(grads)
        tensors = [grads[i] for i in present]
        if tensors and not all(t is v for t, v in zip(tensors, views)):  # (built in place)
            torch._foreach_copy_(views, tensors)
        if missing:
            torch._foreach_zero_(missing)
        return tensors

    def scatter(self, grads: list) -> None:
        """Write the buffer back into the present ``grads``."""
        present, views, _ = self.plan(grads)
        if present and not all(grads[i] is v for i, v in zip(present, views)):
            torch._foreach_copy_([grads[i] for i in present], views)


#: value formats with one codebook per tensor (the whole model in one bucket, gathered)
TENSOR_FORMATS = ("stat2-tensor",)


def _check_reduce(values: str, reduce: str, on_bad_peer: str) -> None:
    """Refuse a ``reduce`` / ``on_bad_peer`` setting that does not fit ``values``."""
    if on_bad_peer not in ("raise", "drop"):
        raise ValueError(f"on_bad_peer must be 'raise' or 'drop', got {on_bad_peer!r}")
    if reduce not in ("gather", "scatter"):
        raise ValueError(f"reduce must be 'gather' or 'scatter', got {reduce!r}")
    if reduce == "scatter" and values == "fp32":
        raise ValueError("reduce='scatter' is for quantised values (bf16, fp16, int8, "
                         "int4); values='fp32' all-reduces, already flat in the group "
                         "size: leave reduce out")
    if reduce == "scatter" and values in TENSOR_FORMATS:
        raise ValueError(f"values={values!r} (one codebook per tensor) needs reduce='gather' "
                         "(a reduce-scatter cuts the values into chunks across tensors)")
    if reduce == "scatter" and on_bad_peer == "drop":
        raise ValueError("on_bad_peer='drop' needs reduce='gather' (with reduce='scatter' "
                         "a bad payload would be dropped from some chunks only)")


def _owner_decay(setting: bool | float | None, error_feedback: float | None, values: str,
                 reduce: str) -> float | None:
    """The decay of the owner's error feedback (None: off), checked."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return error_feedback if reduce == "scatter" else None
    if not isinstance(setting, (int, float)) or not 0.0 < setting <= 1.0:
        raise ValueError(f"owner_error_feedback must be True (error_feedback's decay), "
                         f"None/False (off) or a decay in (0, 1], got {setting!r}")
    if reduce != "scatter" or values == "fp32":
        raise ValueError("owner_error_feedback feeds back the owner's second coding of "
                         "the mean: it needs a quantised reduce='scatter'")
    return float(setting)


class FullReplicator(TokenWeighted, Replicator):
    """Average the whole input over the group: one bucketed exchange per step.

    ``values`` is the wire format: ``"fp32"`` (default) sums in one fp32 all-reduce (with the
    mesh's replicate group this is hybrid-sharded data parallelism, HSDP); ``"bf16"``,
    ``"fp16"``, ``"int8"`` and ``"int4"`` (a scale per ``block`` values, see
    :mod:`flexdemo.compress.quant`) all-gather every rank's encoded bucket and decode the mean
    in rank order, in fp32, identically on every replica (a low-precision all-reduce would
    round partial sums differently per algorithm). Steps that the schedule skips pass the
    input through unchanged.

    ``"stat2-tensor"`` (MuLoCo's 2-bit values) codes each tensor with one statistical
    codebook of its own (:func:`~flexdemo.compress.codebook.tensor_codebook`); it exchanges
    the whole model in one bucket and is gathered.

    ``reduce`` applies to the quantised formats: ``"gather"`` (default) as above, ``n - 1``
    payloads sent per rank; ``"scatter"`` (:mod:`.scatter`): a reduce-scatter of the encoded
    chunks, each chunk's mean encoded again by its owner, then an all-gather of those, at most
    two payloads per rank whatever the group size, for a second rounding of the mean. It pays
    from 3 replicas on (at 2 both send one payload); it needs a transport with an all-to-all.

    ``error_feedback`` (quantised formats; default None: off) keeps on each replica what its
    quantisation lost: ``residual = error_feedback * residual + input``, the residual is
    encoded and sent, and what the peers will decode of it is subtracted (its first encoding).
    A decay of 1.0 is classic error feedback; a lower one forgets old residuals. The residual
    is per-replica state (checkpointed per rank, zeroed for a joiner); a step that fails on
    every replica adds back what it sent, so the residual then holds the input as if it had
    not been sent.

    ``owner_error_feedback`` (``reduce="scatter"``) feeds back the owner's second rounding of
    the mean: each owner keeps ``owner_residual``, what its coding of its chunk of the mean
    lost (``chunk`` values per bucket: 1/n of the values), encodes ``decay * owner_residual +
    mean`` instead of the mean and keeps the new loss once the step stands. Every replica
    still decodes the same all-gathered bytes, and not a byte more is sent. ``True`` uses
    ``error_feedback``'s decay (off without it); a float is its own decay (with or without
    ``error_feedback``); ``None`` (default) or ``False``: off. Off by default because it
    measured worse (benchmarks/archive/results-until-2026-12-07.md, "Owner-side error
    feedback"). Per-rank state like
    the residual (checkpointed per rank, zeroed for a joiner and when the group changes
    size, as chunk ownership moves).

    Received low-precision payloads are checked (header, finite values: an fp16 overflow or a
    corrupt peer): a bad one raises :class:`CorruptPayloadError` naming the sender on every
    replica, or with ``on_bad_peer="drop"`` is left out of the mean on every replica and
    counted in ``dropped_payloads``. ``peer_bound`` (default 8; None or False: off) bounds
    each peer's part of the quantised formats (:mod:`.bound`): a part whose norm is over
    ``peer_bound`` times the median of the parts' norms (with 2 replicas: times the norm of
    this replica's own part) is scaled down to that median (own norm), per bucket; with
    ``reduce="scatter"`` each owner bounds the parts of its chunk and every replica bounds
    each owner's reduced chunk by ``peer_bound`` times the norm of its own part of that chunk.
    Honest runs stay far from it and keep their bits. The fp32 all-reduce sums inside the
    collective, where no peer's part is seen: the bound does nothing there.

    ``bucket_numel`` (default ``"auto"``: 4,194,304 values, 16 MiB in fp32, off CUDA; on it
    an 8th of the model where that is larger; ``None``: the whole model) bounds the exchange's
    buffers: a larger model is exchanged bucket by bucket (fill one reused buffer from the
    input, encode, exchange, decode, write back), so the workspace is a bucket's, not the
    model's. Buckets cut the flat order at multiples of ``block``, so every value is encoded
    and averaged as in one bucket of the whole model: the same bits (the fp32 sum too, on two
    replicas; on more, each bucket's all-reduce may add in another order). The agreement's
    flags ride in the first bucket exchanged (a failed step stops there); error feedback takes
    each bucket's input in and what it sent out as it goes.

    :meth:`start` launches the collective asynchronously and :meth:`finish` completes it (a
    model in several buckets is exchanged in :meth:`finish`); a step reads the device once
    (the agreement and payload checks), or once per bucket with quantised values.

    ``weights="tokens"`` weighs each replica by the tokens it reported for the step
    (``opt.count_tokens(n)``; :mod:`.weights`); ``"equal"`` (default): the plain mean.
    """

    name = "full"
    syncs_replicas = True
    fault_tolerant = True

    def __init__(self, values: str = "fp32", block: int = 128, *, reduce: str = "gather",
                 error_feedback: float | None = None,
                 owner_error_feedback: bool | float | None = None, on_bad_peer: str = "raise",
                 bucket_numel: int | str | None = "auto",
                 peer_bound: float | None = PEER_BOUND, weights: str = "equal",
                 **schedule) -> None:
        super().__init__(**schedule)
        self._init_weights(weights)
        self.codec = ValueCodec(values, block)  # validates
        check_bucket_numel(bucket_numel)
        self.bucket_numel = bucket_numel
        if error_feedback is not None and (
                isinstance(error_feedback, bool) or not isinstance(error_feedback, (int, float))
                or not 0.0 < error_feedback <= 1.0):
            raise ValueError(f"error_feedback must be None (off) or a decay in (0, 1], got "
                             f"{error_feedback!r}")
        if error_feedback is not None and values == "fp32":
            raise ValueError("error_feedback is for quantised values (bf16, fp16, int8, int4, "
                             "int3, int2, stat3, stat2, stat1): fp32 loses nothing; leave it out")
        self.error_feedback = None if error_feedback is None else float(error_feedback)
        self.feedback_decay = self.error_feedback or 0.0
        self.reports_sent = values != "fp32"  # a quantised payload it can decode again
        self.owner_decay = _owner_decay(owner_error_feedback, self.error_feedback, values,
                                        reduce)
        self.owner_error_feedback = owner_error_feedback
        keys = (("residual",) if self.error_feedback is not None else ()) + (
            ("owner_residual",) if self.owner_decay is not None else ())
        if keys:  # per-replica state: the residuals
            self.keeps_replica_state = True
            self.state_tensor_keys = keys
        _check_reduce(values, reduce, on_bad_peer)
        self.values, self.on_bad_peer, self.reduce = values, on_bad_peer, reduce
        self.dropped_payloads = 0
        self.peer_bound = check_peer_bound(peer_bound)
        self.bound = PeerBound(None if values == "fp32" else self.peer_bound, self.name)

    def extra_repr(self) -> str:
        parts = [] if self.values == "fp32" else [f"values={self.values!r}"]
        if self.reduce != "gather":
            parts.append(f"reduce={self.reduce!r}")
        if self.error_feedback is not None:
            parts.append(f"error_feedback={self.error_feedback}")
        if self.owner_decay is not None:
            parts.append(f"owner_error_feedback={self.owner_error_feedback}")
        if self.bucket_numel != "auto":
            parts.append(f"bucket_numel={self.bucket_numel!r}")
        if self.peer_bound != PEER_BOUND and self.values != "fp32":
            parts.append(f"peer_bound={self.peer_bound!r}")
        return ", ".join(parts + ([f"weights={self.weights!r}"] if self.weights != "equal"
                                  else []))

    def _group_resized(self) -> None:
        self._setup_state()  # the fp32 bucket's trailer holds 2 values per replica

    def _setup_state(self) -> None:
        self._total = sum(s.numel() for s in self._local_shapes)
        self._scatter = None
        numel = resolve_bucket_numel(self.bucket_numel, self.device, self._local_shapes,
                                     self.codec.block,
                                     RARE_BUCKETS if self.memory_first else None)
        if self.values in TENSOR_FORMATS:  # a codebook per tensor: the model in one bucket
            numel = None
            self.codec.segments = [s.numel() for s in self._local_shapes]
        self.buckets = None if numel is None else FlatBuckets(self._local_shapes, numel)
        self.residual = None if self.error_feedback is None else torch.zeros(
            self._total, dtype=torch.float32, device=self.device)
        self._decay = torch.tensor(self.error_feedback or 1.0, device=self.device)
        self.owner_residual: torch.Tensor | None = None
        self._spare: ReleasableStorages | None = None  # a bucket's buffers, between syncs
        if numel is not None:
            self._setup_buckets(numel)
            return
        if self.reduce == "scatter" and self.world > 1:
            self._scatter = ScatterExchange(self.codec, self._total, self.world, self.device)
            self._setup_owner([self._total])
            flat = self._scatter.flat
        elif self.values == "fp32":
            self._bucket = torch.zeros(self._total + Agreement.trailer_size(self.world),
                                       dtype=torch.float32, device=self.device)
            flat = self._bucket[: self._total]  # the layout lives in the bucket's front
        else:
            flat = None
            nbytes = HEADER_BYTES + self.codec.nbytes(self._total)
            nbytes += -nbytes % 8  # rows of the gathered tensor stay 8-byte aligned
            self._bucket = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.layout: FlatLayout | None = FlatLayout(self._local_shapes, self.device, flat)

    def _setup_buckets(self, numel: int) -> None:
        """Buffers of one bucket of ``numel`` values, reused by every bucket."""
        self.layout = None
        if self.reduce == "scatter" and self.world > 1:
            self._scatter = ScatterExchange(self.codec, numel, self.world, self.device)
            self._setup_owner(self._bucket_sizes())
            self._stage = self._scatter.padded[:numel]
        elif self.values == "fp32":  # the first bucket carries the agreement's trailer
            self._bucket = torch.zeros(numel + Agreement.trailer_size(self.world),
                                       dtype=torch.float32, device=self.device)
            self._stage = self._bucket[:numel]
        else:
            self._bucket = torch.zeros(self._payload_size(numel), dtype=torch.uint8,
                                       device=self.device)
            self._stage = torch.zeros(numel, dtype=torch.float32, device=self.device)
        # one bucket's buffers: given back between DiLoCo's syncs (release_workspace)
        self._spare = ReleasableStorages(self._scatter.buffers() if self._scatter is not None
                                         else [self._bucket, self._stage])

    def _setup_owner(self, sizes: list[int]) -> None:
        """The owner's residual (owner error feedback): one chunk per bucket of ``sizes``
        values, laid end to end; ``_owner_at[b]`` is where bucket ``b``'s chunk starts."""
        if self.owner_decay is None or self._scatter is None:
            return
        chunks = [self._scatter.sizes(n)[0] for n in sizes]
        self._owner_at = [sum(chunks[:b]) for b in range(len(chunks) + 1)]
        self.owner_residual = torch.zeros(self._owner_at[-1], dtype=torch.float32,
                                          device=self.device)

    def _owner_feedback(self, b: int) -> dict:
        """The owner-feedback arguments of :meth:`ScatterExchange.finish` for bucket ``b``."""
        if self.owner_residual is None:
            return {}
        lo, hi = self._owner_at[b], self._owner_at[b + 1]
        return {"owner_residual": self.owner_residual[lo:hi],
                "owner_decay": self.owner_decay}

    def _bound(self) -> PeerBound | None:
        """The bound on the peers' parts, where it is on."""
        return self.bound if self.bound is not None and self.bound.on else None

    def _payload_size(self, n: int) -> int:
        """Bytes of a gathered payload of ``n`` values (rows stay 8-byte aligned)."""
        return align8(HEADER_BYTES + self.codec.nbytes(n))

    def _bucket_sizes(self) -> list[int]:
        """Values per exchange: each bucket's (the fp32 trailer in the first), or the
        whole model's."""
        if self.buckets is None:
            return [self._total]
        return [hi - lo for lo, hi in self.buckets.bounds]

    def payload_bytes(self) -> int:
        """Bytes this rank contributes to one exchange (flags and headers included)."""
        sizes = self._bucket_sizes()
        if self._scatter is not None:
            sx = self._scatter
            return sum(self.world * sx.sizes(n)[1] + sx.sizes(n)[2] for n in sizes)
        if self.values == "fp32":
            return 4 * (sum(sizes) + (self._bucket.numel() - self._stage_numel()))
        if self.buckets is None:
            return self._bucket.numel()
        return sum(self._payload_size(n) for n in sizes)

    def _stage_numel(self) -> int:
        return self._total if self.buckets is None else self.buckets.numel

    def exchange_bytes(self) -> int:
        sizes = self._bucket_sizes()
        if self._scatter is not None:
            return sum((self.world - 1) * (p + r) for _, p, r in map(self._scatter.sizes, sizes))
        if self.values == "fp32":
            trailer = Agreement.trailer_size(self.world)
            last = len(sizes) - 1  # (exchanged first: it carries the trailer)
            return sum(all_reduce_bytes(n + (trailer if b == last else 0), 4, self.world)
                       for b, n in enumerate(sizes))
        return super().exchange_bytes()

    # ------------------------------------------------------------------ stepping
    def start(self, grads, lrs, step):
        comm = self._begin(grads, step)
        try:
            return self._start(grads, step, comm)
        except NonFiniteGradientError as e:
            if self._withhold(step, comm):
                raise NonFiniteGradientError(self.name, [global_rank_of(self.transport, self.rank)],
                                             step, local=True) from e
            raise

    def finish(self, pending):
        return self._finish(pending)

    def release_workspace(self) -> None:
        """Drop the codec's reused buffer until the next exchange (DiLoCo calls it after each
        sync: a buffer kept for an exchange every H steps would be held between them), and
        the bucket's buffers where it works bucket by bucket (made again, zeroed, at the next
        exchange)."""
        self.codec.release()
        if self._spare is not None:
            self._spare.release()

    def replicate(self, grads, lrs, step, communicate):
        return self._finish(self._start(grads, step, communicate))

    def _start(self, grads, step, communicate):
        if self._spare is not None:
            self._spare.restore()
        self._weigh_inputs(grads, communicate)  # weights="tokens": scaled by w_i n / W
        if not communicate:
            flag = nonfinite_flag(grads, self.device)
            self.agreement.check_local(flag, step)
            return ("local", grads)
        if self.buckets is not None:  # exchanged bucket by bucket in finish()
            code = self.agreement.local([], grads)[1]
            return ("buckets", grads, step, self._buckets_flag(grads), code)
        layout = self.layout
        assert layout is not None, "one bucket: the whole layout"
        layout.fill(grads)
        flag, code = self.agreement.local([layout.flat], grads)
        if self.residual is not None:  # the residual plus the input is what is sent
            self.residual.mul_(torch.where(flag, 1.0, self._decay))
            self.residual.add_(torch.where(flag, 0.0, layout.flat))
            layout.flat.copy_(self.residual)
        if self._scatter is not None:
            handle = self._scatter.start(step, flag, code, self.transport, self.stats)
        elif self.values == "fp32":
            self.agreement.write_trailer(self._bucket[self._total:], flag, code)
            handle = all_reduce_sum(self._bucket, self.transport, self.stats, async_op=True)
        else:
            write_header(self._bucket, step, flag, code)
            self.codec.encode(layout.flat, self._bucket[HEADER_BYTES:])
            handle = all_gather(self._bucket, self.transport, self.stats, async_op=True)
        self._feed_back(-1.0)  # residual -= what the peers will decode of it
        return ("exchange", grads, handle, step, code)

    def _sent(self) -> torch.Tensor:
        """This rank's encoded payload as the peers decode it (``total`` values)."""
        if self._scatter is not None:
            sx = self._scatter
            return sx.codec.decode(sx.send[:, HEADER_BYTES:], sx.chunk).reshape(-1)[
                : self._total]
        return self.codec.decode(self._bucket[HEADER_BYTES:], self._total)

    def sent_into(self, outs: list[torch.Tensor]) -> None:
        """This rank's last payload as the peers decode it (quantised formats), into
        ``outs`` (one bucket of the whole model: ``bucket_numel=None`` or a model that fits
        one)."""
        if not self.reports_sent or self._total == 0:
            return super().sent_into(outs)
        if self.layout is None:
            raise RuntimeError(f"{self.name}: sent_into needs the whole payload, and it was "
                               f"exchanged in {len(self.buckets or ())} buckets; construct "
                               "it with bucket_numel=None")
        parts = torch.split(self._sent(), self.layout.sizes)
        torch._foreach_copy_(outs, [v.view(o.shape) for v, o in zip(parts, outs)])

    def _feed_back(self, sign: float) -> None:
        """Error feedback: add ``sign`` times what this rank sent to its residual (-1 after
        encoding; +1 undoes it after a step that failed on every replica)."""
        if self.residual is not None:
            self.residual.add_(self._sent(), alpha=sign)

    def _finish(self, pending):
        if pending[0] == "local":
            return pending[1]
        if pending[0] == "buckets":
            return self._run_buckets(*pending[1:])
        try:
            return self._finish_exchange(pending)
        except BaseException:
            self._feed_back(1.0)  # nothing was applied: the residual keeps what was sent
            raise

    def _finish_exchange(self, pending):
        _, grads, handle, step, code = pending
        assert self.layout is not None, "one bucket: the whole layout"
        flat = self.layout.flat
        if self._scatter is not None:
            self._scatter.finish(handle, step, code, self.name, self.transport, self.stats,
                                 self.bad_peer, bound=self._bound(), rank=self.rank,
                                 **self._owner_feedback(0))
        elif self.values == "fp32":
            buf = handle.wait()
            self.agreement.read_trailer(buf[self._total:], code, step)
            flat.div_(self.world)
        else:
            self._mean_of_payloads(handle.wait(), flat, step, code)
        self.layout.scatter(grads)
        return grads

    # ------------------------------------------------------------------ buckets
    def _buckets_flag(self, grads: list) -> torch.Tensor:
        """The non-finite flag of the whole input, from the least and largest value of each
        bucket filled in turn (one pass, without a host read; a norm of every tensor costs
        ten times more on a CPU). The last bucket stays in the buffer: it goes first."""
        buckets, stage = self.buckets, self._stage
        assert buckets is not None
        ends: list[torch.Tensor] = []
        for b, (lo, hi) in enumerate(buckets.bounds):
            buckets.fill(b, grads, stage[: hi - lo])
            ends.extend(torch.aminmax(stage[: hi - lo]))
        return ~torch.isfinite(torch.stack(ends)).all()

    def _run_buckets(self, grads: list, step: int, flag: torch.Tensor, code: int) -> list:
        """The exchange of a model in several buckets, one at a time through one buffer,
        last bucket first (it is in the buffer): fill, (error feedback) take the input in,
        exchange, decode the mean, write back. Should a bucket fail (on every replica
        alike), the residual takes in the input of the buckets not sent, as the whole
        exchange's does."""
        buckets, stage = self.buckets, self._stage
        assert buckets is not None
        if self._scatter is None and self.values != "fp32":  # the codec's buffer at its
            self.codec.workspace(buckets.numel, stage.device)  # largest: never grown
        order = list(range(len(buckets)))[::-1]
        taken = -1
        try:
            for k, b in enumerate(order):
                lo, hi = buckets.bounds[b]
                x = stage[: hi - lo]
                if k:
                    buckets.fill(b, grads, x)
                self._take_in(x, lo, hi, flag)
                taken = k
                self._exchange_bucket(k == 0, x, step, flag, code, b)
                if self.residual is not None:  # what it sent leaves the residual
                    self.residual[lo:hi].sub_(self._sent_bucket(hi - lo))
                buckets.scatter(b, grads, x)
        except BaseException:
            if self.residual is not None:
                for b in order[taken + 1:]:
                    lo, hi = buckets.bounds[b]
                    buckets.fill(b, grads, stage[: hi - lo])
                    self._take_in(stage[: hi - lo], lo, hi, flag)
            raise
        return grads

    def _take_in(self, x: torch.Tensor, lo: int, hi: int, flag: torch.Tensor) -> None:
        """Error feedback on one bucket: ``residual = decay * residual + x``, then ``x`` is
        the residual (a non-finite input leaves the residual as it was)."""
        if self.residual is None:
            return
        r = self.residual[lo:hi]
        r.mul_(torch.where(flag, 1.0, self._decay))
        r.add_(torch.where(flag, 0.0, x))
        x.copy_(r)

    def _exchange_bucket(self, first: bool, x: torch.Tensor, step: int, flag: torch.Tensor,
                         code: int, b: int) -> None:
        """Average bucket ``b`` (its ``x.numel()`` values in ``x``) over the group, in place;
        the ``first`` one carries the agreement."""
        n = x.numel()
        if self._scatter is not None:
            sx = self._scatter
            sx.use(n)
            handle = sx.start(step, flag, code, self.transport, self.stats)
            sx.finish(handle, step, code, self.name, self.transport, self.stats, self.bad_peer,
                      bound=self._bound(), rank=self.rank, **self._owner_feedback(b))
        elif self.values == "fp32":
            trailer = Agreement.trailer_size(self.world) if first else 0
            if trailer:
                self.agreement.write_trailer(self._bucket[n: n + trailer], flag, code)
            buf = all_reduce_sum(self._bucket[: n + trailer], self.transport, self.stats)
            if trailer:
                self.agreement.read_trailer(buf[n:], code, step)
            x.div_(self.world)
        else:
            payload = self._bucket[: self._payload_size(n)]
            write_header(payload, step, flag, code)
            self.codec.encode(x, payload[HEADER_BYTES:])
            gathered = all_gather(payload, self.transport, self.stats)
            self._mean_of_payloads(gathered, x, step, code)

    def _sent_bucket(self, n: int) -> torch.Tensor:
        """The last bucket's payload (``n`` values) as the peers decode it."""
        if self._scatter is not None:
            sx = self._scatter
            return sx.codec.decode(sx.send[:, HEADER_BYTES:], sx.chunk).reshape(-1)[:n]
        return self.codec.decode(self._bucket[HEADER_BYTES:], n)

    def _mean_of_payloads(self, gathered: torch.Tensor, flat: torch.Tensor, step: int,
                          code: int) -> None:
        """Check the gathered payloads and write their mean into ``flat``
        (:func:`.gathered.mean_of_payloads`)."""
        mean_of_payloads(gathered, flat, step, code, codec=self.codec, name=self.name,
                         fmt=self.values, bad_peer=self.bad_peer, transport=self.transport,
                         bound=self._bound(), rank=self.rank)

    # ------------------------------------------------------------------ state
    def reset_replica_state(self) -> None:
        for t in self.state_tensors():
            t.zero_()

    def state_dict(self) -> dict:
        return self._state(copy=True)

    def live_state(self) -> dict:
        return self._state(copy=False)

    def _state(self, copy: bool) -> dict:
        sd = {**super().state_dict(), "dropped_payloads": self.dropped_payloads}
        if self.residual is not None:
            sd["residual"] = [self.residual.clone() if copy else self.residual]
        if self.owner_residual is not None:
            sd["owner_residual"] = [self.owner_residual.clone() if copy else self.owner_residual]
        return sd

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.residual, self.owner_residual) if t is not None]

    def input_views(self) -> list[torch.Tensor] | None:
        return None if self.layout is None else self.layout.views

    def load_state_dict(self, state: dict) -> None:
        if self.residual is not None:
            theirs = state.get("residual")
            if not theirs or theirs[0].shape != self.residual.shape:
                raise ValueError(f"{self.name}: the state has no error-feedback residual of "
                                 f"{self._total} values (saved without error_feedback, or "
                                 "for another model?)")
            self.residual.copy_(theirs[0])
        if self.owner_residual is not None:
            theirs = state.get("owner_residual")
            if not theirs or theirs[0].shape != self.owner_residual.shape:
                raise ValueError(f"{self.name}: the state has no owner error-feedback residual "
                                 f"of {self.owner_residual.numel()} values (saved without "
                                 "owner_error_feedback, by an older flexdemo, or for another "
                                 "model or group size?); pass owner_error_feedback=None to "
                                 "load it without")
            self.owner_residual.copy_(theirs[0])
        super().load_state_dict(state)
        self.dropped_payloads = int(state.get("dropped_payloads", 0))


class NoReplication(Replicator):
    """Send nothing: each replica trains on its own gradients (replicas drift apart).

    There is no exchange, so a non-finite gradient raises (or is skipped) on its own replica
    only; no peer waits on it.
    """

    name = "none"

    def payload_bytes(self) -> int:
        return 0

    def replicate(self, grads, lrs, step, communicate):
        self.agreement.check_local(nonfinite_flag(grads, self.device), step)
        return grads

    def _withhold(self, step: int, comm: bool) -> bool:
        """No exchange will ever carry the flag: the error stays this replica's own."""
        return False
