"""DeMo's block layout, built once at set-up: which tensors are compressed together (units),
which units share one matrix of blocks (groups), where every gradient is staged and where its
decoded output is read (views), and where every group's segments sit in the payload."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...compress import BlockDCT, ChunkPlan, Scratch, plan_chunks
from ...compress.bits import packed_nbytes
from ...compress.blocks import BlockValueCodec
from ...compress.dct import BatchedDCT, block_rows
from ...memory import ReleasableStorages
from ..agreement import HEADER_BYTES, align8


@dataclass
class Unit:
    """One compressed tensor: a large parameter, or the batch of small ones."""

    members: list[int]
    sizes: list[int]
    plan: ChunkPlan
    make_transform: Callable[[], BlockDCT]  # the unit's own block DCT (see ``transform``)
    k: int
    part: tuple[int, int] | None = None  # rows [a, b) of its one member (a split tensor)
    index: int = 0  # its place in the replicator's units
    pieces: list[int] = field(default_factory=list)  # its members' pieces (see BlockLayout)
    delta: torch.Tensor | None = None  # set when its group is built
    group: int = 0
    rows: slice = field(default_factory=lambda: slice(0, 0))  # its blocks in the group
    image: slice | None = None  # image-staged units: its padded image in the group's ``img``
    xpad: slice | None = None  # padded units: its staged gradient in the group's ``xpad``
    flat: bool = False  # the batch of small tensors (members concatenated)
    _transform: BlockDCT | None = None

    @property
    def transform(self) -> BlockDCT:
        """The unit's own block DCT, built on first use (the step runs on its group's
        batched transform; this one serves state conversion and inspection)."""
        if self._transform is None:
            self._transform = self.make_transform()
        return self._transform

    @property
    def padded(self) -> bool:
        return self.plan.needs_padding

    @property
    def image_part(self) -> slice:
        """:attr:`image` of an image-staged unit (set when its group is built)."""
        assert self.image is not None, "not an image-staged unit"
        return self.image

    @property
    def xpad_part(self) -> slice:
        """:attr:`xpad` of a padded unit (set when its group is built)."""
        assert self.xpad is not None, "not a padded unit"
        return self.xpad

    @property
    def momentum(self) -> torch.Tensor:
        """:attr:`delta`, once the unit's group is built."""
        assert self.delta is not None, "the unit's group is not built"
        return self.delta

    @property
    def direct(self) -> bool:
        """Staged straight into block rows (a tiling tensor); else through an image."""
        return self.image is None


@dataclass
class Segment:
    """Consecutive units of a group of one kind: staged directly, through an image (the
    batch of small tensors), or padded (momentum in the parameter's domain)."""

    padded: bool
    direct: bool
    units: list[Unit]
    rows: slice  # block rows
    image: slice | None  # entries of the group's image buffer (image-staged units)
    inv: torch.Tensor | None = None  # image row -> block row within the segment
    deltas: list[torch.Tensor] = field(default_factory=list)  # padded: momentum views
    outs: list[torch.Tensor] = field(default_factory=list)  # padded: same in the output image

    @property
    def image_part(self) -> slice:
        """:attr:`image` of an image-staged segment."""
        assert self.image is not None, "not an image-staged segment"
        return self.image


@dataclass
class Group:
    """Units with the same block shape and ``k``: transformed, selected, coded and checked as
    one matrix of blocks, and sent as one index segment and one value segment.

    Coefficients are stored row-major across blocks, ``(cr, blocks, cc)``: row ``u`` of every
    block side by side, so that the first DCT product is one matrix product over the whole
    group. Block ``b``'s coefficient ``l`` (block-local, row-major) sits at
    ``(l // cc, b, l % cc)``.
    """

    units: list[Unit]
    k: int
    chunk: tuple[int, int]
    coef: torch.Tensor  # (cr, blocks, cc): momentum of tiling units; fresh coefficients of padded
    dct: BatchedDCT
    xh: torch.Tensor  # (cr, blocks, cc): the transform's input
    img: torch.Tensor | None = None  # image layout: image-staged units' gradient or momentum
    xpad: torch.Tensor | None = None  # image layout: padded units' staged gradients
    img_src: torch.Tensor | None = None  # rows of ``img`` ...
    img_dst: torch.Tensor | None = None  # ... and where they go in ``xh`` (None: in order)
    segments: list[Segment] = field(default_factory=list)
    pad0: int = 0  # image offset of the padded units (their outputs: the workspace's ``out``)
    idx_off: int = 0
    val_off: int = 0
    end: int = 0

    @property
    def blocks(self) -> int:
        return self.coef.shape[1]

    @property
    def image_buf(self) -> torch.Tensor:
        """:attr:`img` of a group with image-staged units."""
        assert self.img is not None, "the group has no image-staged units"
        return self.img

    @property
    def img_rows(self) -> torch.Tensor:
        """:attr:`img_src` of a group with image-staged units."""
        assert self.img_src is not None, "the group has no image-staged units"
        return self.img_src

    @property
    def xpad_buf(self) -> torch.Tensor:
        """:attr:`xpad` of a group with padded units."""
        assert self.xpad is not None, "the group has no padded units"
        return self.xpad

    @property
    def block_numel(self) -> int:
        return self.chunk[0] * self.chunk[1]

    @property
    def bits(self) -> int:
        """Width of a packed block-local index."""
        return max(1, math.ceil(math.log2(self.block_numel)))

    @property
    def n_sel(self) -> int:
        return self.blocks * self.k


def block_positions(coef_shape: torch.Size, idx: torch.Tensor) -> torch.Tensor:
    """The flat positions in a group's ``coef`` (``(cr, blocks, cc)``) of the block-local
    indices ``idx`` (``(blocks, k)``): block ``b``'s coefficient ``l`` sits at
    ``(l // cc, b, l % cc)``."""
    _, blocks, cc = coef_shape
    block = torch.arange(blocks, device=idx.device).unsqueeze(1)
    return (idx // cc) * (blocks * cc) + block * cc + idx % cc


class Workspace:
    """Scratch buffers shared by the groups, sized for the largest one at set-up (so views of
    them can be built once). The first product of the transform goes to ``z``, then the
    magnitudes of the top-k selection (and image rows on their way to the staging buffer
    before it); the decoded blocks go to the group's own staging buffer ``xh``, free once its
    step is encoded (their coefficients first, then the inverse's product through ``z``),
    and from there into the image they were staged in (``out`` for padded units, whose image
    holds their momentum). One group-sized fp32 buffer besides the staging rows."""

    def __init__(self, groups: list[Group], device: torch.device,
                 compute_dtype: torch.dtype) -> None:
        n = max(g.coef.numel() for g in groups)
        img = max([1] + [g.xpad.numel() for g in groups if g.xpad is not None])

        def buf(numel, dtype=torch.float32):
            return torch.zeros(numel, dtype=dtype, device=device)

        self.z, self.out = buf(n), buf(img)
        low = compute_dtype != torch.float32
        self.xc = buf(n, compute_dtype) if low else None
        self.yc = buf(n, compute_dtype) if low else None
        self.zc = buf(n, compute_dtype) if low else None


def member_view(buf: torch.Tensor, u: Unit, member: int, shape: torch.Size) -> torch.Tensor:
    """The view of member ``member`` of unit ``u`` (shape ``shape``) in the unit's padded
    image ``buf`` (already sliced to the unit)."""
    p = u.plan
    if u.flat:  # the interior of a batch of small tensors is contiguous (no column padding)
        off = sum(u.sizes[:member])
        return buf[off: off + u.sizes[member]].view(shape)
    return buf.view(p.padded)[: p.shape2d[0], : p.shape2d[1]].view(shape)


def interior(buf: torch.Tensor, u: Unit) -> torch.Tensor:
    """The unpadded part of unit ``u``'s image ``buf``, as a matrix."""
    p = u.plan
    return buf.view(p.padded)[: p.shape2d[0], : p.shape2d[1]]


def _blocked(u: Unit) -> tuple[int, int, int, int]:
    """A tiling tensor viewed as ``(block rows, cr, block columns, cc)``."""
    (nbr, nbc), (cr, cc) = u.plan.grid, u.plan.chunk
    return nbr, cr, nbc, cc


def _as_shape(view4: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """``view4`` as a view of ``shape``, or None where its strides do not allow it."""
    try:
        return view4.view(shape)
    except RuntimeError:
        return None


def grad_as(grad: torch.Tensor, four: tuple[int, int, int, int] | None) -> torch.Tensor:
    """The gradient as the tensor its staging or output view expects."""
    if four is None:
        return grad
    try:
        return grad.view(four)
    except RuntimeError:  # a gradient with unusual strides
        return grad.reshape(four)


class BlockLayout:
    """Units, groups, pieces, views and payload offsets of one model's tensors ``shapes``.

    ``small_numel``: tensors that are 1-D or have fewer entries form one batch (None: every
    tensor on its own); ``bucket=False`` makes every unit its own group; ``images``: every unit
    is staged through an image (else only padded units and the small batch);
    ``group_numel``: the most coefficients in a group (None: no bound), large tensors split
    by block rows to fit; ``chunking``: the rule of :func:`~flexdemo.compress.plan_chunks`
    (``"divisor"``: each side's largest divisor up to ``chunk``, and ``k`` scaled to the
    block, ``round(topk * block / chunk^2)``, at least 1); a codec with one codebook per
    group (``per_tensor``, the ``"stat2-tensor"`` values) makes a group of each tensor's
    units (never split; the batch of small tensors one group); ``offload``: the groups'
    coefficients in host memory, stored in ``momentum_dtype`` (:mod:`.offload`);
    ``shared_staging``: every group's block rows ``xh`` are views of one buffer of the largest
    group (the step then stages each group just before its encode)."""

    def __init__(self, shapes: list[torch.Size], *, topk: int, chunk: int,
                 small_numel: int | None, basis: str, compute_dtype: torch.dtype, bucket: bool,
                 images: bool, codec: BlockValueCodec, device: torch.device,
                 group_numel: int | None = None, shared_staging: bool = False,
                 offload: bool = False, momentum_dtype: torch.dtype = torch.float32,
                 chunking: str = "near") -> None:
        self.shapes, self.topk, self.chunk, self.chunking = shapes, topk, chunk, chunking
        # a codec with one codebook per group: a group per tensor, never split
        self.per_tensor = bool(getattr(codec, "per_tensor", False))
        if self.per_tensor:
            group_numel = None
        self.group_numel, self.shared_staging = group_numel, shared_staging
        self.offload = offload  # the momentum of tiling units in host memory (offload.py)
        self.momentum_dtype = momentum_dtype  # ... and its stored dtype
        self.staging_rows: torch.Tensor | None = None  # shared_staging: the groups' ``xh``
        self.basis, self.compute_dtype = basis, compute_dtype
        self.bucket, self.images, self.device = bucket, images, device
        self.scratch = Scratch()
        small = [i for i, s in enumerate(shapes) if s.numel() and small_numel is not None
                 and (len(s) <= 1 or s.numel() < small_numel)]
        self.units: list[Unit] = []
        for i, s in enumerate(shapes):
            if s.numel() and i not in small:
                self.units.extend(self._units_of(i))
        if small:
            total = sum(shapes[i].numel() for i in small)
            rows = math.ceil(total / chunk)
            unit = self._make_unit(small, plan_chunks((rows, chunk), chunk))
            unit.flat = True
            self.units.append(unit)
        # pieces: (parameter, rows of it or None, shape), a unit's members in order
        self.pieces: list[tuple[int, tuple[int, int] | None, torch.Size]] = []
        for j, u in enumerate(self.units):
            u.index = j
            for i in u.members:
                shape = shapes[i] if u.part is None else torch.Size(u.plan.shape)
                u.pieces.append(len(self.pieces))
                self.pieces.append((i, u.part, shape))
        self.groups = self._make_groups()
        off = HEADER_BYTES
        for g in self.groups:
            g.idx_off = off
            off = align8(off + packed_nbytes(g.n_sel, g.bits))
            g.val_off = off
            off = align8(off + codec.nbytes(g.blocks, g.k))
            g.end = off
        self.bucket_bytes = off
        self.work = Workspace(self.groups, device, compute_dtype)
        self._make_views()
        # the step's scratch (no state lives in it), given back between DiLoCo's syncs
        w = self.work
        self.scratch_storages = ReleasableStorages(
            t for t in (self.staging_rows, w.z, w.out, w.xc, w.yc, w.zc) if t is not None)

    def _make_unit(self, members: list[int], plan: ChunkPlan,
                   part: tuple[int, int] | None = None) -> Unit:
        k = min(self.topk, plan.block_numel)
        if self.chunking == "divisor":  # k scaled to the block: the density of topk / chunk^2
            k = min(plan.block_numel,
                    max(1, round(self.topk * plan.block_numel / self.chunk ** 2)))

        def transform() -> BlockDCT:
            return BlockDCT(plan, self.device, scratch=self.scratch, basis=self.basis,
                            compute_dtype=self.compute_dtype)
        sizes = [plan.numel] if part is not None else [self.shapes[i].numel() for i in members]
        return Unit(members, sizes, plan, transform, k, part=part)

    def _units_of(self, i: int) -> list[Unit]:
        """The units of large parameter ``i``: one; or, where only its rows need padding, the
        rows that tile into blocks (momentum in the transform domain) and the rest (padded to
        one row of blocks), split at set-up. The blocks are those of the padded tensor, so
        the algorithm is the same; only the rounding of the momentum of the tiling rows
        differs (it is kept as coefficients). Tiling rows beyond :attr:`group_numel` are
        split by block rows into units that fit a group (the same blocks, the same bits)."""
        shape = tuple(self.shapes[i])
        plan = plan_chunks(shape, self.chunk, self.chunking)
        (rows, cols), (cr, cc) = plan.shape2d, plan.chunk
        tile = rows // cr * cr
        if len(shape) < 2 or cr == 1 or plan.padded[1] != cols or tile == 0:
            return [self._make_unit([i], plan)]
        step = tile  # rows per tiling unit: whole block rows within the bound
        if self.group_numel is not None:
            step = max(cr, self.group_numel // (cr * cols) * cr)
        if tile == rows and step >= rows:
            return [self._make_unit([i], plan)]
        units = [self._make_unit([i], ChunkPlan((b - a, *shape[1:]), (b - a, cols), (cr, cc),
                                                (b - a, cols)), (a, b))
                 for a in range(0, tile, step) for b in [min(tile, a + step)]]
        if tile < rows:
            rest = ChunkPlan((rows - tile, *shape[1:]), (rows - tile, cols), (cr, cc),
                             (cr, cols))
            units.append(self._make_unit([i], rest, (tile, rows)))
        return units

    def _make_groups(self) -> list[Group]:
        """Group the units by (block shape, k), in unit order, each group up to
        :attr:`group_numel` coefficients (a unit larger than that alone); with
        ``bucket=False`` every unit is its own group (one collective each)."""
        keyed: dict = {}
        for j, u in enumerate(self.units):
            # (per_tensor: a unit holds one tensor, or the batch of small ones)
            key: tuple | int = j if not self.bucket else (
                (u.plan.chunk, u.k, u.members[0]) if self.per_tensor else (u.plan.chunk, u.k))
            keyed.setdefault(key, []).append(u)
        runs: list[list[Unit]] = []
        for members in keyed.values():
            # tiling units first, then padded ones, then the batch of small tensors: one run of
            # each kind (blocks are coded alone, so the order changes no bits)
            members.sort(key=lambda u: 2 if u.flat else 1 if u.padded else 0)
            run: list[Unit] = []
            for u in members:
                if run and self.group_numel is not None and (
                        sum(v.plan.padded_numel for v in run) + u.plan.padded_numel
                        > self.group_numel):
                    runs.append(run)
                    run = []
                run.append(u)
            runs.append(run)
        if self.shared_staging:
            most = max(sum(u.plan.num_blocks for u in r) * r[0].plan.block_numel for r in runs)
            self.staging_rows = torch.zeros(most, dtype=torch.float32, device=self.device)
        return [self._make_group(gi, run) for gi, run in enumerate(runs)]

    def _make_group(self, gi: int, units: list[Unit]) -> Group:
        """One group's buffers, layouts and index maps (built once)."""
        dev, f32 = self.device, torch.float32
        (cr, cc), k = units[0].plan.chunk, units[0].k
        blocks = sum(u.plan.num_blocks for u in units)
        stored = self.momentum_dtype
        coef = (torch.zeros(cr, blocks, cc, dtype=stored, device=dev) if not self.offload else
                torch.zeros(cr, blocks, cc, dtype=stored, pin_memory=dev.type == "cuda"))
        xh = (torch.zeros(cr, blocks, cc, dtype=f32, device=dev) if self.staging_rows is None
              else self.staging_rows[: coef.numel()].view(cr, blocks, cc))
        g = Group(units, k, (cr, cc), coef,
                  BatchedDCT((cr, cc), dev, self.basis, self.compute_dtype), xh)
        row = img = pad = 0
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        for u in units:
            u.group, u.rows = gi, slice(row, row + u.plan.num_blocks)
            if u.padded or u.flat or self.images:  # staged through an image
                u.image = slice(img, img + u.plan.padded_numel)
                # block row (b, v) of the unit is image row perm[b * cr + v]; in xh: v, row + b
                src.append(block_rows(u.plan) + img // cc)
                b = torch.arange(u.plan.num_blocks).repeat_interleave(cr)
                v = torch.arange(cr).repeat(u.plan.num_blocks)
                dst.append(v * blocks + row + b)
                img += u.plan.padded_numel
            if u.padded:
                if not pad:
                    g.pad0 = u.image_part.start
                u.xpad = slice(pad, pad + u.plan.padded_numel)
                pad += u.plan.padded_numel
            row += u.plan.num_blocks
        if img:
            g.img = torch.zeros(img, dtype=f32, device=dev)
            src_rows, dst_rows = torch.cat(src), torch.cat(dst)
            if dst_rows.numel() == cr * blocks:  # every block row comes from the image: a gather
                src_rows = torch.empty_like(src_rows).index_copy_(0, dst_rows, src_rows)
                g.img_src = src_rows.to(dev)
            else:
                g.img_src, g.img_dst = src_rows.to(dev), dst_rows.to(dev)
        if pad:
            g.xpad = torch.zeros(pad, dtype=f32, device=dev)
        for u in units:
            # tensors that tile into blocks keep their momentum in the transform domain, in
            # the group's matrix (a (blocks, cr, cc) view); padded ones in their own domain, in
            # their image (the padding stays zero), and use their blocks of the matrix for
            # fresh coefficients
            u.delta = (interior(g.image_buf[u.image_part], u) if u.padded
                       else coef[:, u.rows].permute(1, 0, 2))
        for u in units:  # segments: runs of units of one kind
            last = g.segments[-1] if g.segments else None
            if last is not None and (last.padded, last.direct) == (u.padded, u.direct):
                last.units.append(u)
                last.rows = slice(last.rows.start, u.rows.stop)
                if u.image is not None:
                    last.image = slice(last.image_part.start, u.image.stop)
            else:
                g.segments.append(Segment(u.padded, u.direct, [u], u.rows, u.image))
        for s in g.segments:
            if s.direct:
                continue
            local = torch.cat([block_rows(u.plan) + (u.image_part.start - s.image_part.start) // cc
                               for u in s.units])
            if not torch.equal(local, torch.arange(local.numel())):
                s.inv = torch.argsort(local).to(dev)
        return g

    def out_image(self, g: Group, part: slice, padded: bool) -> torch.Tensor:
        """Where the decoded output of image-staged units ``part`` (entries of ``g.img``)
        goes: back into their image, free once encoded; padded units' image holds their
        momentum, so theirs goes to the workspace's ``out``."""
        if padded:
            return self.work.out[part.start - g.pad0: part.stop - g.pad0]
        return g.image_buf[part]

    def blocks_out(self, g: Group, s: Segment) -> torch.Tensor:
        """Where segment ``s``'s decoded blocks go: ``(blocks, cr, cc)`` in the group's staging
        buffer (block-major: its input is no longer needed), or straight in the output image
        when that is the same layout."""
        cr, cc = g.chunk
        nb = s.rows.stop - s.rows.start
        if not s.direct and s.inv is None:
            return self.out_image(g, s.image_part, s.padded).view(nb, cr, cc)
        bn = g.block_numel
        return g.xh.view(-1)[s.rows.start * bn: s.rows.stop * bn].view(nb, cr, cc)

    def piece(self, grads, p: int) -> torch.Tensor:
        """Piece ``p`` of the gradients: a parameter's gradient, or rows of it."""
        i, part, _ = self.pieces[p]
        return grads[i] if part is None else grads[i].narrow(0, part[0], part[1] - part[0])

    def _make_views(self) -> None:
        """Per piece (a parameter, or rows of one): where its gradient is staged
        (``stage_at``), where its output is read (``out_at``), and the 4-D shape its gradient
        is viewed as for both (``grad_shape4``; None: its own shape)."""
        self.stage_at: dict[int, torch.Tensor] = {}
        self.out_at: dict[int, torch.Tensor] = {}
        self.grad_shape4: dict[int, tuple | None] = {}
        for g in self.groups:
            bn = g.block_numel
            for u in g.units:
                pieces = u.pieces
                if not u.direct:
                    staging = g.xpad_buf[u.xpad_part] if u.padded else g.image_buf[u.image_part]
                    for j, i in enumerate(pieces):
                        shape = self.pieces[i][2]
                        self.stage_at[i] = member_view(staging, u, j, shape)
                        self.out_at[i] = member_view(self.out_image(g, u.image_part, u.padded),
                                                     u, j, shape)
                        self.grad_shape4[i] = None
                    continue
                i = pieces[0]
                shape = self.pieces[i][2]
                nbr, cr, nbc, cc = _blocked(u)
                stage = g.xh[:, u.rows].reshape(cr, nbr, nbc, cc).permute(1, 0, 2, 3)
                out = g.xh.view(-1)[u.rows.start * bn: u.rows.stop * bn]
                out = out.view(nbr, nbc, cr, cc)
                out = out.permute(0, 2, 1, 3)
                flat_stage, flat_out = _as_shape(stage, shape), _as_shape(out, shape)
                if flat_stage is not None and flat_out is not None:
                    self.stage_at[i], self.out_at[i] = flat_stage, flat_out
                    self.grad_shape4[i] = None
                else:
                    self.stage_at[i], self.out_at[i] = stage, out
                    self.grad_shape4[i] = (nbr, cr, nbc, cc)
            for s in g.segments:
                if s.padded:
                    s.deltas = [u.momentum for u in s.units]
                    s.outs = [interior(self.out_image(g, u.image_part, True), u)
                              for u in s.units]
