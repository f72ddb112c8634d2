"""Staging: the plan of a step from the host's view (which gradients are present, which units
share a step size), the copies of the gradients into the groups' buffers and of the decoded
output back into the gradients, and the device-side test of this rank's input for NaN and Inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..agreement import nonfinite_flag, presence_code, zero_where
from .layout import BlockLayout, Group, grad_as

MAX_PLANS = 64  # cached step plans (a training run has few)
#: what one group sent in a step: block-local indices, positions in its matrix, values
Sent = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class MomentumRun:
    """Consecutive units of one segment that have a gradient and the same step size: one
    momentum update."""

    padded: bool
    rows: slice
    image: slice | None
    xpad: slice | None
    unit: int  # a unit of the run: its step size (and class of step size) is the run's

    @property
    def image_part(self) -> slice:
        """:attr:`image` of a run of padded units."""
        assert self.image is not None, "not a run of padded units"
        return self.image

    @property
    def xpad_part(self) -> slice:
        """:attr:`xpad` of a run of padded units."""
        assert self.xpad is not None, "not a run of padded units"
        return self.xpad

    def update_padded(self, g: Group, decay: torch.Tensor, scale: float | torch.Tensor) -> None:
        """A run of padded units of ``g``: ``delta = decay * delta + scale * grad`` in the
        group's image (``scale``: a float, or a 0-d device tensor under CUDA graphs)."""
        momentum = g.image_buf[self.image_part].mul_(decay)
        if isinstance(scale, torch.Tensor):
            momentum.addcmul_(g.xpad_buf[self.xpad_part], scale)
        else:
            momentum.add_(g.xpad_buf[self.xpad_part], alpha=scale)


@dataclass
class StepPlan:
    """What one step's gradients look like, from the host's view (no device reads): which
    units have a gradient, the momentum-update runs, and the tensor lists of the staging and
    write-back copies. Cached per pattern of present gradients and step sizes."""

    code: int  # presence code
    unit_on: list[bool]
    group_on: list[bool]
    present: list[int]  # pieces with a gradient that belong to an active unit
    stage: list[torch.Tensor]  # where their gradients are staged
    zero: list[torch.Tensor]  # staging of members without a gradient, in active units
    runs: list[list[MomentumRun]]
    off_rows: list[list[slice]]  # rows of units without a gradient, per group
    write: list[tuple[list[int], list[torch.Tensor]]]  # per group: pieces, output views
    key: tuple = ()  # (present, classes): the cache key, also a CUDA graph's
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # per group: its
    # entries of ``present``/``stage`` and of ``zero``


class Staging:
    """Step plans (cached) and the copies in and out of one :class:`BlockLayout`."""

    def __init__(self, layout: BlockLayout) -> None:
        self.layout = layout
        self.plans: dict = {}

    def plan(self, present: tuple[bool, ...], classes: tuple[int, ...] | None) -> StepPlan:
        """The host-side plan of a step with gradients ``present`` whose units fall into
        ``classes`` of equal step size (None: all equal), cached: a training run has few such
        patterns."""
        key = (present, classes)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        lay = self.layout
        units = lay.units
        unit_on = [any(present[i] for i in u.members) for u in units]
        on = {id(u): o for u, o in zip(units, unit_on)}
        plan = StepPlan(presence_code([0 if p else None for p in present]), unit_on,
                        [any(on[id(u)] for u in g.units) for g in lay.groups],
                        [], [], [], [], [], [])
        cls = dict(zip(map(id, units), classes or [0] * len(units)))
        for g in lay.groups:
            runs: list[MomentumRun] = []
            off: list[slice] = []
            pieces: list[int] = []
            p0, z0 = len(plan.present), len(plan.zero)
            for u in g.units:
                if not on[id(u)]:
                    off.append(u.rows)
                    continue
                for p in u.pieces:
                    if present[lay.pieces[p][0]]:
                        plan.present.append(p)
                        plan.stage.append(lay.stage_at[p])
                        pieces.append(p)
                    else:
                        plan.zero.append(lay.stage_at[p])
                if u.flat and u.image_part.stop - u.image_part.start > sum(u.sizes):
                    # the small batch's padding: its image also receives decoded output
                    plan.zero.append(g.image_buf[u.image_part.start + sum(u.sizes):
                                             u.image_part.stop])
                last = runs[-1] if runs else None
                if (last is not None and last.padded == u.padded
                        and cls[id(units[last.unit])] == cls[id(u)]
                        and last.rows.stop == u.rows.start):
                    last.rows = slice(last.rows.start, u.rows.stop)
                    if u.padded:
                        last.image = slice(last.image_part.start, u.image_part.stop)
                        last.xpad = slice(last.xpad_part.start, u.xpad_part.stop)
                else:
                    runs.append(MomentumRun(u.padded, u.rows, u.image, u.xpad, u.index))
            plan.spans.append((p0, len(plan.present), z0, len(plan.zero)))
            plan.runs.append(runs)
            plan.off_rows.append(off)
            plan.write.append((pieces, [lay.out_at[p] for p in pieces]))
        plan.key = key
        self.plans[key] = plan
        return plan

    def stage(self, grads, plan: StepPlan) -> None:
        """The gradients into the groups' block rows and images (one multi-tensor copy)."""
        lay = self.layout
        if plan.present:
            torch._foreach_copy_(plan.stage, [grad_as(lay.piece(grads, p), lay.grad_shape4[p])
                                              for p in plan.present])
        if plan.zero:
            torch._foreach_zero_(plan.zero)

    def stage_group(self, grads, plan: StepPlan, gi: int) -> None:
        """Group ``gi``'s gradients into its block rows and images (shared staging)."""
        lay, (p0, p1, z0, z1) = self.layout, plan.spans[gi]
        if p1 > p0:
            torch._foreach_copy_(plan.stage[p0:p1], [
                grad_as(lay.piece(grads, p), lay.grad_shape4[p]) for p in plan.present[p0:p1]])
        if z1 > z0:
            torch._foreach_zero_(plan.zero[z0:z1])

    def nonfinite_grad_flag(self, grads, plan: StepPlan) -> torch.Tensor:
        """:meth:`nonfinite_input_flag` from the gradients themselves, before any is staged
        (:func:`~flexdemo.replicate.agreement.nonfinite_flag`: exact, a fixed number of ops)."""
        lay = self.layout
        return nonfinite_flag([lay.piece(grads, p) for p in plan.present], lay.device)

    def write_back(self, grads, pieces: list[int], views: list[torch.Tensor]) -> None:
        """The decoded output into the gradients' ``pieces`` (one multi-tensor copy)."""
        lay = self.layout
        targets, sources = [], []
        for p, v in zip(pieces, views):
            four, grad = lay.grad_shape4[p], lay.piece(grads, p)
            if four is None:
                targets.append(grad)
                sources.append(v)
                continue
            try:
                targets.append(grad.view(four))
                sources.append(v)
            except RuntimeError:  # a gradient with unusual strides: copy it on its own
                grad.copy_(v.reshape(grad.shape))
        if targets:
            torch._foreach_copy_(targets, sources)

    def staged_inputs(self, gi: int) -> list[torch.Tensor]:
        """The buffers group ``gi``'s input is staged in: its block rows (where units are
        staged directly), the staged gradients of its padded units, and the images of the
        other image-staged units (the small-tensor batch; every tiling unit under
        ``staging="image"``)."""
        g = self.layout.groups[gi]
        direct = [g.xh] if any(s.direct for s in g.segments) else []
        return direct + ([g.xpad] if g.xpad is not None else []) + [
            g.image_buf[s.image_part] for s in g.segments if not s.padded and not s.direct]

    def nonfinite_input_flag(self, plan: StepPlan) -> torch.Tensor:
        """A 0-d device flag, set when a staged input holds a NaN or Inf: the least and
        largest entry of every staging buffer (NaN and Inf propagate, no overflow), then one
        finiteness test."""
        ends = [e for gi, on in enumerate(plan.group_on) if on
                for buf in self.staged_inputs(gi) for e in torch.aminmax(buf)]
        if not ends:
            return torch.zeros((), dtype=torch.bool, device=self.layout.device)
        return ~torch.isfinite(torch.stack(ends)).all()

    def zero_inputs_where(self, bad: torch.Tensor, plan: StepPlan) -> None:
        """Zero every staged input where ``bad`` (a 0-d device flag) is set (one in-place
        pass per staging buffer, no host read). With a low-precision transform only the
        padded units' gradients here: the rest is zeroed in the (smaller) copy of the block
        rows in the compute dtype."""
        for gi, on in enumerate(plan.group_on):
            if on:
                self.zero_group_where(bad, gi)

    def zero_group_where(self, bad: torch.Tensor, gi: int) -> None:
        """:meth:`zero_inputs_where` of group ``gi``."""
        g = self.layout.groups[gi]
        low = self.layout.work.xc is not None
        for buf in ([g.xpad] if g.xpad is not None else []) if low else self.staged_inputs(gi):
            zero_where(buf, bad)
