"""The DeMo replicator: its settings, its set-up, the stages of the algorithm and the step
that runs them (see the package's docstring for the algorithm, the wire format and the
modes)."""

from __future__ import annotations

import torch

from ...compress.bits import pack_bits
from ...compress.blocks import BlockValueCodec
from ...compress.select import topk_blocks_rowmajor
from ...transport import all_gather
from ..agreement import HEADER_BYTES, write_header, zero_where
from ..base import Replicator
from ..bound import PEER_BOUND, PeerBound, check_peer_bound
from ..rounding import STATE_DTYPES
from ..weights import TokenWeighted
from . import state
from .decode import (
    add_back_own,
    blocks_into_image,
    dense_inverse,
    write_own,
)
from .delayed import InFlight
from .graphs import CompiledSelection, StepGraphs
from .layout import BlockLayout, Group
from .mean import CheckedMean
from .offload import HostMomentum
from .scatter import SparseScatter
from .settings import (
    PRESETS,
    TRANSFORM_DTYPES,
    check_settings,
    describe,
    rare_groups,
    resolve_group_numel,
)
from .shared import SharedIndices
from .staging import MomentumRun, Sent, Staging, StepPlan

# staging="auto" stages through images under CUDA graphs below this many entries per tensor
# (on one H100 a graphed direct step is then bound by its per-tensor copies, not the GPU)
IMAGE_NUMEL = 500_000


class DeMoReplicator(TokenWeighted, CheckedMean, Replicator):
    """DeMo replication (DCT top-k of a decoupled momentum, with error feedback).

    Defaults: 16 of the 4096 coefficients of each 64 x 64 block, values as ``int2`` — about
    0.008 bytes per parameter per step, chosen from ``benchmarks/bench_wire.py`` (loss within
    2% of fp32 values at topk 32, which sends 5.5x more). :data:`PRESETS` names other settings.
    ``weights="tokens"`` weighs each replica's gradient by its reported tokens (:mod:`..weights`).
    """

    name = "demo"
    keeps_replica_state = True  # momentum and error feedback
    syncs_replicas = True
    state_tensor_keys = ("delta",)  # the momentum (error feedback): per replica
    fault_tolerant = True
    exchange_settings = {"decay": 1.0, "sign": False, "scale_by_lr": False}  # plain EF
    state_tensors = state.live_tensors  # the momentum, without the copies of state_dict

    def __init__(self, topk: int = 16, chunk: int = 64, decay: float = 0.999, *,
                 sign: bool = True, scale_by_lr: bool = True, values: str = "int2",
                 transform: str = "dct", transform_dtype: str = "fp32", small: str = "batch",
                 small_numel: int | None = None, bucket: bool = True, overlap: str = "none",
                 on_bad_peer: str = "raise",
                 compile: bool = False, graphs: bool | str = "auto", staging: str = "auto",
                 mean: str = "replicas", clip: str = "none", reduce: str = "gather",
                 group_numel: int | str | None = "auto", offload: bool = False,
                 momentum_dtype: str = "fp32", peer_bound: float | None = PEER_BOUND,
                 chunking: str = "near", weights: str = "equal", **schedule) -> None:
        super().__init__(**schedule)
        self._init_weights(weights, "the senders' mean with reduce other than 'gather' or "
                           "overlap='delayed'" if mean == "senders" and (
                               reduce != "gather" or overlap != "none") else None)
        graphs = check_settings(
            topk=topk, chunk=chunk, decay=decay, values=values, transform=transform,
            transform_dtype=transform_dtype, small=small, small_numel=small_numel,
            bucket=bucket, overlap=overlap, on_bad_peer=on_bad_peer, compile=compile,
            graphs=graphs, staging=staging, mean=mean, clip=clip, reduce=reduce,
            group_numel=group_numel, offload=offload, momentum_dtype=momentum_dtype,
            chunking=chunking, every_step=self.replicate_every == 1 and not self.skip_every)
        self.mean, self.clip, self.reduce = mean, clip, reduce
        # each peer's part bounded (..bound): a multiple of the median norm, or of its own
        self.peer_bound = check_peer_bound(peer_bound)
        self.bound: PeerBound = PeerBound(self.peer_bound, self.name)
        # the workspace; the momentum in host memory, and its stored dtype (offload.py)
        self.group_numel, self.offload, self.momentum_dtype = group_numel, offload, momentum_dtype
        self.topk, self.chunk, self.decay = topk, chunk, float(decay)
        self.chunking = chunking
        self.feedback_decay = self.decay  # its momentum is its error feedback
        self.sign, self.scale_by_lr, self.values = sign, scale_by_lr, values
        self.transform, self.transform_dtype, self.small = transform, transform_dtype, small
        self.small_numel = chunk * chunk if small_numel is None else small_numel
        self.bucket, self.overlap, self.on_bad_peer = bucket, overlap, on_bad_peer
        self.codec, self.dropped_payloads = BlockValueCodec(values), 0
        # torch.compile of the top-k selection (same results; falls back to eager on failure)
        self.compile = bool(compile)
        self._compiled = CompiledSelection(self.name, lambda: setattr(self, "compile", False))
        # CUDA graphs of the device work between the host's steps (no effect off CUDA)
        self.graphs, self.staging = graphs, staging
        self.reports_sent = reduce != "scatter" and overlap == "none"  # (sent_into)

    @classmethod
    def preset(cls, name: str, **overrides) -> DeMoReplicator:
        """A replicator from a named preset (:data:`PRESETS`), with settings overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown DeMo preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def extra_repr(self) -> str:
        return describe(self)

    # ------------------------------------------------------------------ set-up
    def _transform_basis(self) -> tuple[str, torch.dtype]:
        """The transform's basis and the dtype of its forward products."""
        if self.transform == "dct":
            return "dct", TRANSFORM_DTYPES[self.transform_dtype]
        return "identity", torch.float32

    @property
    def _graphed(self) -> bool:
        return bool(self.graphs) and self.device is not None and self.device.type == "cuda"

    @property
    def _stages_through_images(self) -> bool:
        """Every unit staged through its image (``staging="image"``; ``"auto"``: under CUDA
        graphs, below 500k entries per tensor): contiguous copies in and out and one gather
        per group into block rows, inside the graphs; more GPU time than strided copies, so
        it pays where the host's launches bound the step (shards)."""
        if self.staging == "auto":  # where a graphed step is bound by the host's launches
            numel = sum(s.numel() for s in self._local_shapes)
            return self._graphed and numel < IMAGE_NUMEL * len(self._local_shapes)
        return self.staging == "image"

    def _setup_state(self) -> None:
        basis, compute_dtype = self._transform_basis()
        self.layout = BlockLayout(
            self._local_shapes, topk=self.topk, chunk=self.chunk,
            small_numel=self.small_numel if self.small == "batch" else None, basis=basis,
            compute_dtype=compute_dtype, bucket=self.bucket,
            group_numel=resolve_group_numel(self.group_numel, self.device, self._local_shapes,
                                            rare_groups(self)),
            images=self._stages_through_images, codec=self.codec, device=self.device,
            shared_staging=not self._graphed, offload=self.offload,  # graphs: fixed buffers
            momentum_dtype=STATE_DTYPES[self.momentum_dtype], chunking=self.chunking)
        self.scratch, self.units, self.groups = (self.layout.scratch, self.layout.units,
                                                 self.layout.groups)
        self._work = self.layout.work
        self.host_momentum = HostMomentum(self.groups, self.device, self.offload,
                                          STATE_DTYPES[self.momentum_dtype])
        self.bucket_bytes = self.layout.bucket_bytes
        self.staging_plans = Staging(self.layout)
        nbuf = 2 if self.overlap == "delayed" else 1  # this rank's payloads
        self.send_buffers = [torch.zeros(self.bucket_bytes, dtype=torch.uint8,
                                         device=self.device) for _ in range(nbuf)]
        self.inflight = InFlight(  # delayed mode: the exchange in flight, deferred verdict
            self, self.send_buffers, self.groups, self.codec, self.staging_plans)
        # the momentum's decay factor, and 1 for a step whose input is not finite
        self._decay_factor = torch.tensor(self.decay, dtype=torch.float32, device=self.device)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        # CUDA graphs: the step and the step sizes as device scalars, filled before a replay
        self.step_graphs = StepGraphs(self.name, lambda: setattr(self, "graphs", False))
        self._lr_of_class: list[float] = []
        self._step_on_device = torch.zeros((), dtype=torch.int64, device=self.device)
        self._lrs_on_device = torch.zeros(max(1, len(self.units)), dtype=torch.float32,
                                          device=self.device)
        # reduce="scatter" / "shared": its buffers per group size, those the encode packs into
        self._scatters: dict[int, SparseScatter | SharedIndices] = {}
        self._parts: SparseScatter | SharedIndices | None = None

    @property
    def delta(self) -> list[torch.Tensor]:
        """The momentum buffers, one per unit (large tensor, or the small-tensor batch):
        views of the DCT coefficients ``(blocks, cr, cc)`` of tensors that tile into blocks,
        the tensor as a matrix for padded ones."""
        return [u.momentum for u in self.units]

    def payload_bytes(self) -> int:
        """Bytes this rank contributes to one exchange (header and alignment included;
        ``reduce="scatter"``: its ``n`` parts and its owner part; ``"shared"``: also its
        index lists)."""
        return self.bucket_bytes if (sx := self._scattered()) is None else sx.payload_bytes()

    def exchange_bytes(self) -> int:
        sx = self._scattered()  # an all-to-all, then an all-gather ("shared": 2 all-gathers)
        return super().exchange_bytes() if sx is None else sx.exchange_bytes()

    def _scattered(self) -> SparseScatter | SharedIndices | None:
        """``reduce="scatter"`` or ``"shared"`` over several ranks: its buffers for the
        group's size."""
        if self.reduce != "gather" and self.world > 1 and self.world not in self._scatters:
            self._scatters[self.world] = SharedIndices(
                self.layout, self.codec, self.world, name=self.name
            ) if self.reduce == "shared" else SparseScatter(
                self.layout, self.codec, self.world, senders=self.mean == "senders",
                name=self.name)
        return self._scatters.get(self.world)  # filled under reduce="scatter"/"shared" only

    def plan_step(self, grads, lrs) -> StepPlan:
        """The step's plan (which gradients are present, which units share a step size);
        notes the step size of each class for the device scalars."""
        present = tuple(g is not None for g in grads)
        if lrs is None or not self.scale_by_lr:
            return self.staging_plans.plan(present, None)
        classes: dict = {}  # which units share a step size (not the sizes: they change)
        plan = self.staging_plans.plan(
            present, tuple(classes.setdefault(lrs[u.members[0]], len(classes))
                           for u in self.units))
        self._lr_of_class = list(classes)  # the step size of each class, in class order
        return plan

    # ------------------------------------------------------------------ the step
    def replicate(self, grads, lrs, step, communicate):
        """One DeMo step; each stage runs once per group of blocks of one shape:

        1. momentum ``delta = decay * delta + s * grad``, kept in the DCT domain
           (:meth:`_update_momentum`);
        2. the top-k coefficients of every block (:meth:`_select_topk`), packed into this
           rank's payload (:meth:`_pack_payload`);
        3. error feedback: ``delta -= `` what the peers will decode (:meth:`add_to_momentum`);
        4. all-gather the payloads (:meth:`_exchange`) and check them (:meth:`_check_now`);
        5. the peers' mean through the inverse DCT, then ``sign()``, into ``grads``
           (:meth:`write_mean`).

        Steps 1-3 are :meth:`encode_payload`. ``overlap="delayed"`` applies step 5 to the
        payloads of the step before (:meth:`_replicate_delayed`)."""
        self.layout.scratch_storages.restore()  # given back after the last sync, if so
        self._weigh_inputs(grads, communicate)  # weights="tokens": the gradient scaled
        if self.overlap == "delayed":
            return self._replicate_delayed(grads, lrs, step)
        if self.reduce != "gather" and communicate:  # block owners reduce (.scatter, .shared)
            return self._replicate_scattered(grads, lrs, step)
        plan = self.plan_step(grads, lrs)
        buf = self.send_buffers[0]
        # decay + encode, select, code, error feedback: this rank's payload (what it fed
        # back is not kept: should the exchange fail, it is added back from ``buf``)
        self.encode_payload(grads, lrs, step, buf)
        # exchange (a group of one, or a step the schedule skips, keeps its own)
        gathered = self._exchange(buf) if communicate else buf.unsqueeze(0)
        try:  # check every payload on the device; the step's one read of the verdict
            good, decoded, factors = self._check_now(gathered, step, plan)
        except Exception:
            add_back_own(self.add_to_momentum, self.groups, self.codec, buf, plan)
            raise
        # decode the mean of the good payloads, inverse DCT, sign, write into the gradients
        self.write_mean(decoded, good, plan, plan, grads, factors=factors)
        return grads

    def _replicate_scattered(self, grads, lrs, step):
        """A communicating step of ``reduce="scatter"`` (:class:`~.scatter.SparseScatter`) or
        ``"shared"`` (:class:`~.shared.SharedIndices`)."""
        plan, ex = self.plan_step(grads, lrs), self._scattered()
        assert ex is not None, f"reduce={self.reduce!r} communicates over several ranks"
        self._parts = ex  # the encode packs into the owners' parts (or this rank's indices)
        try:  # decay + encode, select, error feedback ("shared": the indices only)
            sent = self.encode_payload(grads, lrs, step, ex.bucket)
        finally:
            self._parts = None
        if isinstance(ex, SharedIndices):  # the shared set, then this rank's values there
            sent = ex.share_values(plan, self.rank, self.transport, self.stats,
                                   self.add_to_momentum)
        try:
            mean = ex.exchange(plan, step, self.transport, self.stats, self.bad_peer,
                               rank=self.rank, bound=self.bound)
        except Exception:
            self._undo_error_feedback(sent)
            raise
        ex.write_mean(mean, plan, grads, self.staging_plans, sign=self.sign)
        return grads

    def _replicate_delayed(self, grads, lrs, step):
        """One step of ``overlap="delayed"``: check what was sent last step, encode and send
        this step's, and apply last step's mean."""
        plan = self.plan_step(grads, lrs)
        received = self.inflight.receive()  # last step's payloads, before encoding
        self.inflight.send(grads, lrs, step, plan, self.transport, self.stats, self.rank)
        self.inflight.apply(received, plan, grads)
        return grads

    # ------------------------------------------------------------------ encode
    def encode_payload(self, grads, lrs, step: int, buf: torch.Tensor) -> list:
        """This rank's payload for ``step`` in ``buf``; returns per group the sent
        (indices, positions, values) where ``reduce="scatter"`` or CUDA graphs keep them,
        else None (each group's freed once encoded: a failed gather adds back ``buf``).

        A rank whose input holds a NaN or Inf leaves its momentum as it was, decided on the
        device: the flag is found first (least and largest staged input), the staged input
        is zeroed and the decay factor is 1 where it is set, and the selected values are
        sent as zeros (so error feedback changes nothing); the header carries the flag."""
        self.layout.scratch_storages.restore()
        plan = self.plan_step(grads, lrs)
        self.host_momentum.begin(step, self.rank)  # bf16: the key of its rounding
        if self.layout.shared_staging:  # each group staged just before its encode
            return self._encode_staged(plan, lrs, step, buf, grads)
        self.staging_plans.stage(grads, plan)
        if not self._graphed:
            return self._encode_staged(plan, lrs, step, buf)
        # the device scalars the graph reads, set by fills (no host-to-device copy)
        self._step_on_device.fill_(step)
        for c, v in enumerate(self._lr_of_class if self.scale_by_lr and lrs is not None
                              else ()):
            self._lrs_on_device[c].fill_(v)
        return self.step_graphs.run(
            ("fill", plan.key, buf.data_ptr()),
            lambda: self._encode_staged(plan, lrs, self._step_on_device, buf))

    def _encode_staged(self, plan: StepPlan, lrs, step: int | torch.Tensor,
                       buf: torch.Tensor, grads=None) -> list:
        """:meth:`encode_payload` after the staging: all device work, the same for every
        step of one shape (a CUDA graph on CUDA unless ``graphs=False``). With ``grads``
        (shared staging) each group is staged here, just before its encode."""
        st = self.staging_plans
        if grads is None:
            bad = st.nonfinite_input_flag(plan)
            st.zero_inputs_where(bad, plan)
        else:  # each group's input is zeroed as it is staged
            bad = st.nonfinite_grad_flag(grads, plan)
        decay = torch.where(bad, self._one, self._decay_factor)
        keep = self._graphed or self._parts is not None  # (see encode_payload)
        sent: list[Sent | None] = []
        for gi, g in enumerate(self.groups):
            if not plan.group_on[gi]:
                buf[g.idx_off: g.end].zero_()
                sent.append(None)
                continue
            if grads is not None:
                st.stage_group(grads, plan, gi)
                st.zero_group_where(bad, gi)
            self._update_momentum(g, plan.runs[gi], lrs, decay, bad,  # delta = decay delta + s g
                                  plan.key[1])
            idx, pos, vals = self._select_topk(g, plan.off_rows[gi], bad)  # of every block
            seen = self._pack_payload(g, idx, vals, buf)  # packed indices, coded values
            if seen is None:  # reduce="shared": values go once the shared set is known
                sent.append(None)
                continue
            self.add_to_momentum(g, idx, pos, seen, sign=-1.0)  # delta -= what peers see
            sent.append((idx, pos, seen) if keep else None)
        write_header(buf, step, bad, plan.code)  # on the device: no host round trip
        return sent

    def _step_size(self, r: MomentumRun, lrs,
                   classes: tuple[int, ...] | None) -> float | torch.Tensor:
        """Run ``r``'s step size: a float, or under CUDA graphs its class's device scalar."""
        if not self.scale_by_lr or lrs is None:
            return 1.0
        if self._graphed:
            assert classes is not None  # graphed steps group the step sizes in classes
            return self._lrs_on_device[classes[r.unit]]
        return float(lrs[self.units[r.unit].members[0]])

    def _update_momentum(self, g: Group, runs: list[MomentumRun], lrs, decay: torch.Tensor,
                         bad: torch.Tensor, classes: tuple[int, ...] | None = None) -> None:
        """Momentum update and forward DCT of all blocks of ``g`` with a gradient: tiling
        units ``coef = decay * coef + s * DCT(grad)``, padded units
        ``delta = decay * delta + s * grad`` and ``coef = DCT(delta)``. ``decay`` is a 0-d
        device tensor: 1 on a rank whose input is not finite (``bad``; its staged input is
        then zero, so its momentum stays as it was, bit for bit). Decaying first and adding the
        product with ``beta = 1`` gives the bits of one product with ``beta = decay``."""
        self.host_momentum.bring(g)  # offload=True: from host memory
        w, cc, n = self._work, g.chunk[1], g.coef.numel()
        scale = {id(r): self._step_size(r, lrs, classes) for r in runs}
        for r in runs:
            if r.padded:
                r.update_padded(g, decay, scale[id(r)])
        if g.img is not None:  # image-staged units: their rows into the block rows
            if g.img_dst is None:  # all of them, straight into the block rows
                torch.index_select(g.img.view(-1, cc), 0, g.img_rows, out=g.xh.view(-1, cc))
            else:
                rows = torch.index_select(g.img.view(-1, cc), 0, g.img_rows,
                                          out=w.z[: g.img_rows.numel() * cc].view(-1, cc))
                g.xh.view(-1, cc).index_copy_(0, g.img_dst, rows)
        x = g.xh
        if w.xc is not None:  # a non-finite input is zeroed in the compute dtype's copy
            x = zero_where(w.xc[:n].view_as(g.xh).copy_(g.xh), bad)
        y = g.dct.rows(x, out=(w.z if w.yc is None else w.yc)[:n].view_as(g.xh))
        # on a CPU a low-precision product is widened into ``z`` (free then) before it is
        # added: a mixed-precision add there allocates a model-sized temporary (GPUs cast in
        # the kernel)
        wide = w.z if w.yc is not None and self.device.type == "cpu" else None
        for r in runs:
            if r.padded:  # fresh coefficients of the momentum in the parameter's domain
                g.dct.cols_into(y, g.coef, r.rows, 1.0, 0.0, w.zc, wide)
            else:  # coef = decay * coef + s * DCT(grad); the decay is the device factor
                g.coef[:, r.rows].mul_(decay)
                g.dct.cols_into(y, g.coef, r.rows, scale[id(r)], 1.0, w.zc, wide)

    def _select_topk(self, g: Group, off_rows: list[slice], bad: torch.Tensor):
        """Top-k coefficients of every block: ``(blocks, k)`` block-local indices, their
        positions in ``coef`` and their values; units without a gradient keep their momentum
        and send zeros, and so does every unit where ``bad`` (non-finite input) is set."""
        k = g.k if not isinstance(self._parts, SharedIndices) else self._parts.k_of(g)
        idx_pos = self._compiled(g) if self.compile and k == g.k else None
        if idx_pos is None:
            idx_pos = topk_blocks_rowmajor(g.coef, k, self._work.z[: g.coef.numel()],
                                           self.scratch)
        idx, pos = idx_pos
        vals = g.coef.view(-1).index_select(0, pos.view(-1)).view(pos.shape).masked_fill_(bad, 0.0)
        for rows in off_rows:
            vals[rows] = 0.0
        return idx, pos, vals

    def _pack_payload(self, g: Group, idx: torch.Tensor, vals: torch.Tensor,
                      buf: torch.Tensor) -> torch.Tensor | None:
        """Pack the indices and code the values into the group's segments of ``buf``;
        returns the values as the peers will decode them (None: ``reduce="shared"``)."""
        if self._parts is not None:  # into the owners' parts (or this rank's index list)
            return self._parts.pack(g, idx, vals)
        pack_bits(idx, g.bits, buf[g.idx_off: g.val_off])
        return self.codec.encode(vals, buf[g.val_off: g.end])

    def add_to_momentum(self, g: Group, idx: torch.Tensor, pos: torch.Tensor,
                         vals: torch.Tensor, sign: float) -> None:
        """Add ``sign * sent`` to the momentum (sign -1: error feedback, +1: undo it): to the
        coefficients of tiling units, and through the inverse DCT to the momentum of padded
        units (their blocks of ``coef`` only hold this step's fresh coefficients)."""
        self.host_momentum.bring(g)
        g.coef.view(-1).scatter_add_(0, pos.view(-1), (vals if sign > 0 else -vals).view(-1))
        for s in g.segments:
            if s.padded:
                blocks = dense_inverse(self.layout, g, s, [(idx[s.rows], vals[s.rows])], 1)
                blocks_into_image(self.layout, g, s, blocks)
                torch._foreach_add_(s.deltas, s.outs, alpha=sign)
        self.host_momentum.send()  # offload=True: back to host memory

    def _undo_error_feedback(self, sent: list[Sent | None]) -> None:
        """After a failed exchange every rank adds back what it sent (a rank whose input was
        not finite sent zeros and changed nothing): its momentum is then as after the
        momentum update alone (no extra read of the device)."""
        for g, s in zip(self.groups, sent):
            if s is not None:
                self.add_to_momentum(g, *s, sign=1.0)

    # ------------------------------------------------------------------ exchange
    def _exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """Every replica's payload, ``(peers, bytes)``."""
        if self.bucket:
            return all_gather(buf, self.transport, self.stats)
        n = self.world
        out = torch.empty(n, buf.numel(), dtype=buf.dtype, device=buf.device)
        out[:, :HEADER_BYTES] = all_gather(buf[:HEADER_BYTES].clone(), self.transport, self.stats)
        for g in self.groups:  # one per tensor (bucket=False makes a group of each unit)
            out[:, g.idx_off: g.end] = all_gather(buf[g.idx_off: g.end].clone(), self.transport,
                                                  self.stats)
        return out

    # ------------------------------------------------------------------ check
    def on_payloads(self, key: tuple, fn, gathered: torch.Tensor):
        """``fn(gathered)``, through a CUDA graph for ``key`` when graphed."""
        if not self._graphed:
            return fn(gathered)
        return self.step_graphs.run_on_payloads(key, fn, gathered)

    def _decode(self, gathered: torch.Tensor, grads, step: int, code: int) -> None:
        """Check ``gathered`` payloads of ``step`` and write their decoded mean into
        ``grads`` (``code``: this rank's presence code, as computed from ``grads``)."""
        plan = self.plan_step(grads, None)
        if code != plan.code:
            raise ValueError(f"{self.name}: presence code {code} does not match the gradients")
        good, decoded, factors = self._check_now(gathered, step, plan)
        self.write_mean(decoded, good, plan, plan, grads, factors=factors)

    # ------------------------------------------------------------------ contract
    def sent_into(self, outs) -> None:
        """What this rank sent in its last exchange, as the peers decode it, into ``outs``."""
        if not self.reports_sent:
            return super().sent_into(outs)
        self.layout.scratch_storages.restore()
        plan = self.plan_step(outs, None)
        if isinstance(ex := self._scattered(), SharedIndices):  # reduce="shared"
            return ex.sent_into(plan, outs, self.staging_plans)
        write_own(self.layout, self.staging_plans, self.codec, self.send_buffers[0], plan, outs)

    def release_workspace(self) -> None:
        """Give back the step's scratch buffers until the next step (DiLoCo calls it after
        each sync, H steps apart); kept under CUDA graphs, which captured their addresses."""
        if not self._graphed:
            self.layout.scratch_storages.release()
            self.layout.scratch.clear()

    def quorum_changed(self) -> None:
        self.inflight.drop()
        super().quorum_changed()

    def reset_replica_state(self) -> None:
        state.reset(self)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return self.inflight.save(state.save(self, super().state_dict()))

    def live_state(self) -> dict:
        return self.inflight.save(state.save(self, super().state_dict(), copy=False),
                                  copy=False)

    def load_state_dict(self, sd: dict) -> None:
        deltas = state.check_loadable(self, sd)
        super().load_state_dict(sd)
        state.load(self, sd, deltas)
        self.inflight.load(sd, len(self._shapes or ()), self.rank)

