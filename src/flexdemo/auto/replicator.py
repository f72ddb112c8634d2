"""``"auto"``: a replicator that measures the link and the step, then becomes the best fit.

The life of an :class:`AutoReplicator` (``prepare(model, "auto", optimizer=...)``):

1. **Set-up** (in ``prepare()``, every rank at once): the bounded probe of the replicate
   group's link (:func:`~flexdemo.auto.link.probe_link`, at most ``probe_seconds``), unless a
   ``link`` is given. A single replica decides here: nothing to send, ``"none"``. With
   ``compute_seconds`` given, every replica decides here too and trains with the choice from
   step 0.
2. **Warm-up** (steps ``0 .. warmup - 1``): local steps, nothing exchanged, so the step's
   compute time is measured alone (the time between the starts of two optimizer steps: data,
   forward, backward and the base step). The replicas start from the same parameters (a copy
   of them is kept) and drift apart as DiLoCo's replicas do between syncs.
3. **The decision** (at step ``warmup``): one all-gather over the whole world makes every rank
   take the same inputs (the slowest compute, the slowest bandwidth, the largest latency, any
   probe that timed out, each candidate's largest payload over the shards), then
   :func:`~flexdemo.auto.choose.choose` picks, identically on every rank, and one line says
   what and why. A DiLoCo-family choice takes the warm-up steps as the first inner steps of
   its first period (its global copy is the kept start). Any other choice (full sync) first
   gives every replica the first replica's parameters and base-optimizer state (one
   broadcast), so the replicas are bitwise identical from there on; this needs the optimizer,
   which ``prepare()`` and :class:`~flexdemo.SimulatedReplicas` bind (``bind_optimizer``).
4. **After**: every call goes to the chosen replicator. ``decision`` holds the
   :class:`~flexdemo.auto.choose.Decision`, ``history`` every decision, retune and resize as
   JSON.
5. **Retuning** (:mod:`.retune`; on by default when the link was probed): the exchanges' own
   times, agreed at a safe boundary (a DiLoCo period with no sync in flight, every 10 steps
   of full sync), show a link more than 2x slower (and costing over the budget) or faster at
   2 checks in a row (a collapse, over 10x slower and over half of the steps exposed: at the
   first); every rank then decides again at that step and, if the choice changes,
   hands over as in 3. (a DiLoCo-family choice starts from the old global copy, full sync
   from the first replica's state).

Checkpoints: the state holds the decision and the chosen replicator's state (during the
warm-up: the kept start and the times measured). Loading it into a fresh ``"auto"`` rebuilds
the chosen replicator from the decision, without a new one, so a run resumes bitwise with
the strategy it had; the representation (``repr``) does not name the choice, so checkpoints
of any decision load. Under fault tolerance the link is not probed (the quorum forms at the
first step): ``link=`` or the fallback link, a decision for at least 2 replicas, no
retuning unless asked for; when the quorum's size changes, one line says what the choice costs
at the new size and the choice stays.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from ..dtensor import local_tensor
from ..replicate import FRONTIER, Replicator, make_replicator
from ..replicate.agreement import NonFiniteGradientError, global_rank_of, nonfinite_flag
from ..transport import InProcessTransport, ProcessGroupTransport, Transport
from .choose import (
    Candidate,
    Decision,
    Sizing,
    choose,
    load_ranking,
    size_candidate,
    sync_slots,
)
from .link import FALLBACK_LINK, Link, parse_link, probe_link
from .retune import Retuner

__all__ = ["AutoReplicator"]


def _copy_first_replica(tensors: list[torch.Tensor], transport: Transport) -> None:
    """Overwrite ``tensors`` with group rank 0's (one broadcast; in-process: a gather)."""
    tensors = [local_tensor(t) for t in tensors if t.numel()]
    if transport.size <= 1 or not tensors:
        return
    if isinstance(transport, ProcessGroupTransport):
        from ..sharding import broadcast_tensors  # sharding imports the optimizer
        broadcast_tensors(tensors, transport.group)
        return
    flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
    buf = torch.cat(flat)
    out = torch.empty(transport.size * buf.numel(), dtype=torch.uint8, device=buf.device)
    transport.all_gather_into(out, buf)
    first, off = out[: buf.numel()], 0
    for t, f in zip(tensors, flat):
        t.view(-1).view(torch.uint8).copy_(first[off: off + f.numel()])
        off += f.numel()


class AutoReplicator(Replicator):
    """Measure the link and the step, choose the strategy (see the module).

    Args:
        budget: the largest share of a step that exposed communication may take (0.05).
        warmup: local steps that measure the compute time before the decision (4; the first
            period is left out when there are several).
        probe_seconds: the bound of the link probe (2.0).
        link: skip the probe: ``"100mbit,1ms"``, a dict or a :class:`~flexdemo.auto.Link`.
        compute_seconds: skip the warm-up: the compute time of one step, in seconds.
        candidates: names of ranking entries to choose among (default: all).
        ranking: another ranking file (default: the package's ``quality_ranking.json``).
        retune: decide again when the exchanges' own times show the link changed by more
            than ``retune_factor`` at ``retune_checks`` checks in a row (:mod:`.retune`);
            default: when the link was probed (a link given stays as given).
        verbose: print the decision's line (on the first rank) to stderr.
    """

    name = "auto"
    fault_tolerant = True

    def __init__(self, *, budget: float = 0.05, warmup: int = 4, probe_seconds: float = 2.0,
                 link: str | dict | Link | None = None, compute_seconds: float | None = None,
                 candidates: list[str] | None = None, ranking: str | None = None,
                 retune: bool | None = None, retune_factor: float = 2.0,
                 retune_checks: int = 2, verbose: bool = True, group=None) -> None:
        super().__init__(group=group)
        if not isinstance(budget, (int, float)) or not 0 < budget < 1:
            raise ValueError(f"auto: budget must be a share of the step in (0, 1), got "
                             f"{budget!r}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"auto: warmup must be an integer >= 1, got {warmup!r}")
        if not isinstance(probe_seconds, (int, float)) or not probe_seconds > 0:
            raise ValueError(f"auto: probe_seconds must be > 0, got {probe_seconds!r}")
        if compute_seconds is not None and not (isinstance(compute_seconds, (int, float))
                                                and compute_seconds > 0):
            raise ValueError(f"auto: compute_seconds must be > 0, got {compute_seconds!r}")
        self.budget, self.warmup, self.probe_seconds = float(budget), warmup, probe_seconds
        self.link = link
        self._given_link = None if link is None else parse_link(link)
        self.compute_seconds = compute_seconds
        self.ranking = ranking
        ranked = load_ranking(ranking)
        if candidates is not None:
            names = [c.name for c in ranked]
            odd = [c for c in candidates if c not in names]
            if odd or not candidates:
                raise ValueError(f"auto: unknown candidates {odd}; choose among {names}")
            ranked = [c for c in ranked if c.name in candidates]
        self.candidates = candidates
        self._ranked: list[Candidate] = ranked
        if not isinstance(retune_factor, (int, float)) or not retune_factor > 1:
            raise ValueError(f"auto: retune_factor must be > 1, got {retune_factor!r}")
        if not isinstance(retune_checks, int) or retune_checks < 1:
            raise ValueError(f"auto: retune_checks must be an integer >= 1, got "
                             f"{retune_checks!r}")
        self.retune, self.retune_factor, self.retune_checks = retune, retune_factor, retune_checks
        self._retuner = Retuner(retune_factor, retune_checks)
        self.verbose = verbose
        self.chosen: Replicator | None = None
        self.decision: Decision | None = None
        self.history: list[dict] = []
        self.retune_seconds: list[dict] = []  # each retune's cost on this rank: step, seconds
        self.lines: list[str] = []
        self._optimizer = None
        self._inflight: list = []
        self.probed: Link | None = None  # this rank's own measurement (or the link given)

    def extra_repr(self) -> str:  # the settings only: checkpoints of any decision load
        return f"budget={self.budget}, warmup={self.warmup}"

    def bind_optimizer(self, optimizer) -> None:
        """The optimizer this replicator serves (``prepare()`` and ``SimulatedReplicas``
        bind it): a full-sync choice after the warm-up gives every replica the first one's
        base-optimizer state through it."""
        self._optimizer = optimizer

    # ------------------------------------------------------------------ set-up
    def setup(self, shapes, device, default_group, params=None, nonfinite="raise") -> None:
        super().setup(shapes, device, default_group, params, nonfinite)
        self._probeable = isinstance(self.transport, (ProcessGroupTransport,
                                                      InProcessTransport))
        self._agree_over = (ProcessGroupTransport(None)
                            if isinstance(self.transport, ProcessGroupTransport)
                            and dist.is_initialized() else self.transport)
        self._periods: list[float] = []
        self._last: float | None = None
        self._bad = False
        self._start: list[torch.Tensor] | None = None
        self._retunes = (self._given_link is None and self._probeable if self.retune is None
                         else self.retune)
        if self.world <= 1 and self._probeable:
            self._adopt(Decision("none", "none (no replication)", "none", {}, 1, FALLBACK_LINK,
                                 0.0, self.budget, reason="nothing to send", step=0), fresh=True)
            return
        self.probed = self._measure_link()
        if self.compute_seconds is not None:  # nothing to measure: decide before step 0
            self._decide(0, fresh=True)
            return
        self._start = [p.detach().float().clone() for p in self._params or []]

    def _measure_link(self) -> Link:
        if self._given_link is not None:
            return self._given_link
        if not self._probeable:
            return FALLBACK_LINK
        link, self._inflight = probe_link(self.transport, self.probe_seconds,
                                          device=self.device)
        return link

    # ------------------------------------------------------------------ the decision
    def _sizings(self, world: int) -> list[Sizing | None]:
        shapes = self._local_shapes
        return [size_candidate(c, shapes, world) for c in self._ranked]

    def _decide(self, step: int, fresh: bool = False) -> None:
        """Agree on the inputs over the whole world, choose, adopt the choice."""
        compute = self.compute_seconds
        if compute is None:
            samples = self._periods[1:] if len(self._periods) > 1 else self._periods
            compute = statistics.median(samples) if samples else 0.0
        replicas = self._replicas()
        link = self.probed or FALLBACK_LINK
        head = [compute, link.bandwidth, link.latency, float(link.timed_out),
                float(link.source == "fallback"), float(self._bad), link.seconds]
        top, low, sizings = self._gather(head, self._sizings(replicas))
        compute, timed_out, fallback, bad = top[0], top[3] > 0, top[4] > 0, top[5] > 0
        if timed_out or fallback:
            took = f"probe timed out after {self.probe_seconds:g} s" if timed_out else \
                "no probe over this group (fault tolerance)"
            link, note = replace(FALLBACK_LINK, seconds=top[6], timed_out=timed_out), took
        else:
            link, note = Link(low[1], top[2], link.source, top[6]), ""
        ranked, sizings = self._allowed(sizings, fresh)
        decision = choose(ranked, sizings, link, compute, replicas, self.budget, step, note)
        self._adopt(decision, fresh=fresh)
        if bad and self.nonfinite == "raise":  # a warm-up step some replica skipped alone
            raise NonFiniteGradientError(self.name, None, step,
                                         note=" (in a warm-up step before the decision)")

    def _replicas(self) -> int:
        return self.world if self._probeable else max(self.world, 2)

    def _gather(self, head: list[float], sizings: list[Sizing | None]
                ) -> tuple[list[float], list[float], list[Sizing | None]]:
        """One all-gather over the world: the largest and smallest of ``head`` over the ranks,
        and each candidate's sizing with its largest syncs (None where some rank has none)."""
        mine = list(head)
        for c, s in zip(self._ranked, sizings):  # slots known before sizing: one layout
            slots = sync_slots(c)
            mine += [0.0, *[0.0] * slots] if s is None else [1.0, *map(float, s.syncs)]
        agree = self._agree_over
        vec = torch.tensor(mine, dtype=torch.float64, device=self.device)
        out = torch.empty(agree.size * vec.numel(), dtype=torch.float64, device=self.device)
        agree.all_gather_into(out, vec)
        rows = out.view(agree.size, vec.numel()).cpu()
        top, low = rows.max(dim=0).values.tolist(), rows.min(dim=0).values.tolist()
        at, agreed = len(head), []
        for c, s in zip(self._ranked, sizings):  # applies on every rank: the largest bytes
            slots = sync_slots(c)
            ok = low[at] > 0 and s is not None
            agreed.append(Sizing(s.period, tuple(int(b) for b in top[at + 1: at + 1 + slots]),
                                 s.collectives, s.overlap) if ok and s is not None else None)
            at += 1 + slots
        return top[: len(head)], low[: len(head)], agreed

    def _allowed(self, sizings: list[Sizing | None], fresh: bool
                 ) -> tuple[list[Candidate], list[Sizing | None]]:
        """Replicas that drifted apart (after a warm-up or a DiLoCo) and no optimizer to
        copy the first one's state from: only the DiLoCo family can take over."""
        ranked = self._ranked
        if fresh or self._optimizer is not None:
            return ranked, sizings
        keep = [i for i, c in enumerate(ranked) if self._restarts(c) and sizings[i]]
        if not keep:
            raise ValueError(f"auto: the candidates {[c.name for c in ranked]} need the "
                             "optimizer after the warm-up (bind_optimizer); build it with "
                             "prepare() or give compute_seconds")
        return [ranked[i] for i in keep], [sizings[i] for i in keep]

    @staticmethod
    def _restarts(c: Candidate) -> bool:
        """Whether ``c`` restarts replicas from a global copy (DiLoCo family): it can take
        over warm-up steps that drifted apart without the optimizer's help."""
        return c.replicator == "diloco" or c.replicator in FRONTIER

    def _adopt(self, decision: Decision, fresh: bool, state: dict | None = None) -> None:
        """Build the decided replicator on this group and hand over to it."""
        rep = make_replicator(decision.replicator, **decision.replicator_kwargs)
        rep.setup(self._local_shapes, self.device, self.group, self._params, self.nonfinite)
        rep.stats = self.stats  # one account of bytes and time
        if state is not None:
            rep.load_state_dict(state)
        elif not fresh and self._start is not None:
            glob = getattr(rep, "global_params", None)
            if glob is not None:  # the warm-up steps are the first inner steps
                torch._foreach_copy_(glob, self._start)
            else:  # the same parameters and base state on every replica from here on
                self._copy_first_replica()
        self._start = None
        self.chosen, self.decision = rep, decision
        if state is None:
            self.history.append({"event": "decision", **decision.as_dict()})
        self._say(decision.line() + (" (resumed)" if state is not None else ""))

    def _copy_first_replica(self) -> None:
        tensors = list(self._params or [])
        opt = self._optimizer
        if opt is not None:
            base = opt.base
            for p in opt.params:
                st = base.state.get(p, {})
                tensors += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
        _copy_first_replica(tensors, self.transport)

    def _say(self, line: str) -> None:
        self.lines.append(line)
        first = self.rank == 0 and (not dist.is_initialized()
                                    or not isinstance(self.transport, ProcessGroupTransport)
                                    or dist.get_rank() == 0)
        if self.verbose and first:
            print(line, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ stepping
    def replicate(self, grads, lrs, step, communicate):
        now = time.perf_counter()
        if self._last is not None:  # the step before: start to start
            if self.chosen is None:
                self._periods.append(now - self._last)
            else:
                self._retuner.window.step_time(now - self._last)
        self._last = now
        if self.chosen is None and step >= self.warmup:
            self._decide(step)
        if self.chosen is not None:
            return self.chosen.replicate(grads, lrs, step, communicate)
        if bool(nonfinite_flag(grads, self.device)):  # only this replica knows: it skips
            self._bad = True
            raise NonFiniteGradientError(self.name, [global_rank_of(self.transport, self.rank)],
                                         step, local=True)
        return grads

    def after_step(self, step: int) -> None:
        if self.chosen is None:
            return
        self.chosen.after_step(step)
        if not self._retunes or self.world <= 1 or self.decision is None:
            return
        st, rt = self.stats, self._retuner
        rt.window.step_done(st.last_seconds, st.last_bytes_sent, st.last_collectives)
        rt.after_step(step, int(getattr(self.chosen, "inner_steps", 1)))
        if rt.due and not getattr(self.chosen, "pending", None):  # a safe boundary
            self._check(step)

    # ------------------------------------------------------------------ retuning
    def _check(self, step: int) -> None:
        """Agree on what the exchanges measured; decide again after a sustained change."""
        d = self.decision
        assert d is not None
        t0 = time.perf_counter()
        replicas = self._replicas()
        sizings = self._sizings(replicas)
        current = next((s for c, s in zip(self._ranked, sizings) if c.name == d.name), None)
        seen = (self._retuner.window.estimate(d.link, current) if current is not None
                else (float("inf"), 0.0, 0.0))
        top, low, sizings = self._gather(list(seen), sizings)
        # the rank that waited least arrived last: its time is the link's, not a peer's skew
        if not self._retuner.verdict(d.link, top[0], low[2], self.budget):
            return
        link = Link(top[0], d.link.latency, "in-band")
        ranked, sizings = self._allowed(sizings, fresh=False)
        new = choose(ranked, sizings, link, top[1], replicas, self.budget, step,
                     f"retuned: the syncs measured {link.mbit:.3g} Mbit/s, "
                     f"the decision assumed {d.link.mbit:.3g}")
        if new.name != d.name:
            self._switch(new)
        else:
            self.decision = new
        # what the retune cost this rank: the agreed check, the choice and the hand-over
        took = time.perf_counter() - t0
        self.history.append({"event": "retune", **new.as_dict()})  # agreed: equal on all ranks
        self.retune_seconds.append({"step": step, "seconds": took})  # this rank's own
        self._say(f"auto: retune at step {step} (the link was {d.link.describe()}): "
                  f"{new.line()[len('auto: '):]}{' (stays)' if new.name == d.name else ''} "
                  f"[took {took * 1e3:.1f} ms]")

    def _switch(self, new: Decision) -> None:
        """Hand over at a safe boundary: a DiLoCo-family choice starts from the point the
        replicas last agreed on (the old global copy, or the identical parameters of full
        sync); full sync first gives every replica the first one's parameters and state."""
        old = self.chosen
        assert old is not None
        rep = make_replicator(new.replicator, **new.replicator_kwargs)
        rep.setup(self._local_shapes, self.device, self.group, self._params, self.nonfinite)
        rep.stats = self.stats
        glob_new, glob_old = (getattr(r, "global_params", None) for r in (rep, old))
        if glob_new is not None and glob_old is not None:
            torch._foreach_copy_(glob_new, glob_old)
        elif glob_new is None and not old.keeps_replicas_identical(self.world):
            self._copy_first_replica()
        self.chosen, self.decision = rep, new

    def rebind(self) -> None:
        """A quorum of another size (fault tolerance): one line with the choice's cost at
        the new size; the choice stays."""
        before = self.world
        super().rebind()
        d = self.decision
        if d is None or self.world == before or self.world <= 1:
            return
        cand = next((c for c in self._ranked if c.name == d.name), None)
        if cand is None:
            return
        s = size_candidate(cand, self._local_shapes, self.world)
        if s is None:
            return
        e = s.exposed_seconds(d.link, d.compute_seconds)
        share = e / (d.compute_seconds + e) if d.compute_seconds + e > 0 else 0.0
        over = f", over the {d.budget * 100:.2g}% budget" if share > d.budget else ""
        self.history.append({"event": "resize", "replicas": self.world, "was": before,
                             "bytes_per_step": s.bytes_per_step, "exposed_share": share})
        self._say(f"auto: {self.world} replicas now (was {before}); {d.label} stays "
                  f"({s.bytes_per_step / 1e6:.2g} MB/step, exposed comm "
                  f"{share * 100:.2g}%{over})")

    # ------------------------------------------------------------------ contract
    def payload_bytes(self) -> int:
        return 0 if self.chosen is None else self.chosen.payload_bytes()

    def exchange_bytes(self) -> int:
        return 0 if self.chosen is None else self.chosen.exchange_bytes()

    def inner_replicators(self) -> tuple[Replicator, ...]:
        return () if self.chosen is None else (self.chosen,)

    def keeps_replicas_identical(self, replicas: int) -> bool:
        return self.chosen is not None and self.chosen.keeps_replicas_identical(replicas)

    def tensor_state_keys(self) -> set[str]:
        """None: the state's layout depends on the decision, so it travels as one object
        (a fresh ``"auto"`` has no tensors of the choice to load into)."""
        return set()

    def shared_state(self) -> dict:
        return {} if self.chosen is None else self.chosen.shared_state()

    def load_shared_state(self, state: dict) -> None:
        if self.chosen is not None:
            self.chosen.load_shared_state(state)
        self.reset_withheld()

    def reset_replica_state(self) -> None:
        if self.chosen is not None:
            self.chosen.reset_replica_state()

    def state_tensors(self) -> list[torch.Tensor]:
        return self.chosen.state_tensors() if self.chosen is not None else list(
            self._start or [])

    def state_dict(self) -> dict:
        return self._state(copy=True)

    def live_state(self) -> dict:
        return self._state(copy=False)

    def _state(self, copy: bool) -> dict:
        sd = super().state_dict()
        sd["history"] = list(self.history)
        sd["retune"] = self._retuner.state_dict()
        if self.chosen is not None and self.decision is not None:
            sd["decision"] = self.decision.as_dict()
            sd["chosen"] = self.chosen.state_dict() if copy else self.chosen.live_state()
        else:
            sd["periods"] = list(self._periods)
            sd["bad"] = self._bad
            sd["start"] = [t.clone() if copy else t for t in self._start or []]
        return sd

    def load_state_dict(self, state: dict) -> None:
        if "decision" in state:
            saved = Decision.from_dict(state["decision"])
            if self.decision is None or self.decision.as_dict() != saved.as_dict():
                self._adopt(saved, fresh=True, state=state["chosen"])
            else:
                assert self.chosen is not None
                self.chosen.load_state_dict(state["chosen"])
        elif self.chosen is not None:
            raise ValueError("auto: the state is from before the decision, this replicator "
                             "has decided; load it into a fresh one")
        else:
            self._periods = [float(x) for x in state.get("periods", [])]
            self._bad = bool(state.get("bad", False))
            start = state.get("start") or []
            if self._start is not None and start:
                torch._foreach_copy_(self._start, start)
        self._last = None  # no period across a resume
        self.history = list(state.get("history", self.history))
        self._retuner.load_state_dict(state.get("retune", {}))
        super().load_state_dict(state)
