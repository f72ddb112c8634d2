"""The replicator interface: what crosses the slow link, on which group, and how often.

A replicator takes the shard-local gradients of one step (a list with ``None`` for
parameters that received no gradient) and returns the tensors the next stage sees: the next
replicator of a chain, or finally the base optimizer. On a step its schedule skips, it runs
*locally*: it exchanges nothing and behaves as if its group had one member.

Schedules (steps count from 0): a replicator communicates on step ``t`` when
``t % replicate_every == 0`` and, if ``skip_every > 0``, ``(t + 1) % skip_every != 0``.

Every exchange carries the replicas' non-finite flags (:class:`Agreement`); a non-finite input
on a step without exchange is withheld and reported at the next one. Both, and the payload
header, live in :mod:`.agreement`.
"""

from __future__ import annotations

import inspect
import warnings
import zlib
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ..transport import (
    CommStats,
    Transport,
    all_gather_bytes,
    gather_into,
    group_rank,
    group_ranks,
    group_size,
    transport_for,
)
from .agreement import (
    Agreement,
    CorruptPayloadError,
    NonFiniteGradientError,
    global_rank_of,
    mark_nonfinite,
)
from .bound import PeerBound


def check_schedule(replicate_every: int, skip_every: int) -> None:
    if not isinstance(replicate_every, int) or replicate_every < 1:
        raise ValueError(f"replicate_every must be an integer >= 1, got {replicate_every!r}")
    if not isinstance(skip_every, int) or skip_every < 0 or skip_every == 1:
        raise ValueError(
            f"skip_every must be 0 (never skip) or an integer >= 2, got {skip_every!r} "
            "(skip_every=1 would never replicate; use NoReplication instead)"
        )



def setting_names(*chain) -> list[str]:
    """The keyword settings of a chain of factories, each forwarding ``**kwargs`` to the next
    (a class stands for its constructor, then its base classes' constructors): the named
    parameters, in order, up to the first factory that forwards nothing."""
    names: list[str] = []
    for f in (c for link in chain for c in (inspect.getmro(link) if isinstance(link, type)
                                             else (link,))):
        if f is object or (isinstance(f, type) and "__init__" not in f.__dict__):
            continue
        params = inspect.signature(f.__dict__["__init__"] if isinstance(f, type) else f).parameters
        names += [n for n, p in params.items() if n not in ("self", "cls") and n not in names
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return names


class Replicator(ABC):
    """Base class of all replication schemes, and the contract the rest of flexdemo reads.

    The optimizer, the checkpoints (:mod:`flexdemo.checkpoint` and its DCP helpers), the
    emulated cluster and fault tolerance (:mod:`flexdemo.ft`) know a replicator only through
    what this class declares; none of them names a concrete class:

    * :attr:`syncs_replicas` / :meth:`keeps_replicas_identical`: whether the replicas'
      parameters stay bitwise identical (checkpoints then store them once);
    * :attr:`state_tensor_keys`: the entries of :meth:`state_dict` that are lists of
      fixed-shape tensors (stored per rank as DCP tensors); :meth:`shared_state` /
      :meth:`load_shared_state`: the state equal on every replica (what a joining replica
      fetches) and :meth:`reset_replica_state`: the per-replica rest, which starts from zero;
    * :meth:`live_state`: the state with its live tensors (fault tolerance copies it once
      per step into buffers of its own);
    * :meth:`reset_withheld`: forget a non-finite step withheld for the next exchange;
    * :attr:`on_bad_peer` and :attr:`dropped_payloads`: the bad-peer policy and its counter
      (:meth:`bad_peer` applies them); :attr:`bound` and :meth:`clipped_contributions`: the
      bound on each peer's part of an exchange (:mod:`.bound`) and its count;
    * :attr:`transport`: the group's transport, bound once in :meth:`setup`;
    * :meth:`inner_replicators`: replicators this one runs inside itself (DiLoCo's
      exchanges, a phased replicator's phases);
    * :meth:`fault_tolerance_problem`: why the replicator cannot run under fault tolerance;
    * :attr:`memory_first` and :meth:`release_workspace`: for an exchange that runs once
      every many steps (DiLoCo's sync), workspace sized for memory rather than speed, and
      given back between uses.
    """

    name = "replicator"
    #: the outputs of an exchange are equal on every replica of the group (then a replicator
    #: that exchanges on every step keeps the replicas bitwise identical)
    syncs_replicas: bool = False
    #: entries of :meth:`state_dict` that are lists of fixed-shape tensors
    state_tensor_keys: tuple[str, ...] = ()
    #: what to do with a peer's payload that fails the checks: ``"raise"`` or ``"drop"``
    on_bad_peer: str = "raise"
    #: payloads left out under ``on_bad_peer="drop"``
    dropped_payloads: int = 0
    #: its bound on each peer's part of an exchange (:mod:`.bound`; None: it has none)
    bound: PeerBound | None = None
    #: whether :mod:`flexdemo.ft` may run it (see :meth:`fault_tolerance_problem`)
    fault_tolerant: bool = False
    #: it keeps per-replica state, such as error feedback (:meth:`reset_replica_state`)
    keeps_replica_state: bool = False
    #: settings it takes by default as DiLoCo's exchange (given by name)
    exchange_settings: dict = {}
    #: it can tell what it sent in its last exchange (:meth:`sent_into`)
    reports_sent: bool = False
    #: the decay of its error feedback (``residual = decay * residual + input - sent``;
    #: 0: none, what it does not send is dropped)
    feedback_decay: float = 0.0
    #: set before :meth:`setup` by a caller that runs it once every many steps (DiLoCo's
    #: sync, whose workspace comes on top of all the state and gradients): where it has the
    #: choice, it sizes its workspace for memory rather than speed (DeMo: smaller "auto"
    #: groups, one group's payloads unpacked at a time; full sync: smaller "auto" buckets)
    memory_first: bool = False
    #: set before an exchange by a caller that scaled each rank's input by a factor (DiLoCo's
    #: weighted mean, :mod:`.pace`): the factors of the group's ranks (fp32, ``(world,)``, on
    #: the device, equal on every rank), or None (unscaled). A mean over all ranks needs
    #: nothing (the factors are in the inputs); a mean over the senders divides by the sum of
    #: the senders' factors instead of their number (DeMo's ``mean="senders"``)
    peer_scales: torch.Tensor | None = None

    def __init__(self, *, group: dist.ProcessGroup | Transport | None = None,
                 replicate_every: int = 1, skip_every: int = 0) -> None:
        check_schedule(replicate_every, skip_every)
        self.group = group
        self.replicate_every = replicate_every
        self.skip_every = skip_every
        self.stats = CommStats()
        self._shapes: list[torch.Size] | None = None

    # ------------------------------------------------------------------ setup
    @property
    def is_set_up(self) -> bool:
        """Whether :meth:`setup` has bound this replicator to its parameters."""
        return self._shapes is not None

    def setup(self, shapes: list[torch.Size], device: torch.device,
              default_group: dist.ProcessGroup | Transport | None,
              params: list[torch.Tensor] | None = None, nonfinite: str = "raise") -> None:
        """Bind to the local parameter shapes; allocate state. Called once by the optimizer.

        ``params`` are the rank-local parameter tensors, for replicators that act on
        parameters (DiLoCo) rather than only on gradients. ``nonfinite`` is the optimizer's
        policy (``"raise"`` or ``"skip"``).
        """
        if self.group is None:
            self.group = default_group
        self._shapes = [torch.Size(s) for s in shapes]
        self._params = params
        self.device = torch.device(device)
        self.world = group_size(self.group)
        self.rank = group_rank(self.group)
        self.transport = transport_for(self.group)  # bound once: every collective uses it
        self.nonfinite = nonfinite
        self.agreement = Agreement(self.name, self.rank, self.world, self.device,
                                   self.transport)
        self._withheld: int | None = None  # first step withheld since the last exchange
        self._check_group_shapes()
        self._setup_state()

    def _setup_state(self) -> None:  # noqa: B027 - optional hook
        """Allocate per-parameter state (override)."""

    def release_workspace(self) -> None:  # noqa: B027 - optional hook
        """Give back scratch buffers until the next exchange, which makes them again
        (override; DiLoCo calls it after each sync, H steps apart)."""

    def _check_group_shapes(self) -> None:
        """All ranks of the group must hold the same local shapes (one tiny collective; none
        over a transport that only sizes payloads, ``sizing_only``)."""
        if self.world <= 1 or getattr(self.transport, "sizing_only", False):
            return
        code = zlib.crc32(repr([tuple(s) for s in self._local_shapes]).encode())
        mine = torch.tensor([code], dtype=torch.int64, device=self.device)
        out = torch.empty(self.world, dtype=torch.int64, device=self.device)
        gather_into(out, mine, self.transport)
        bad = [r for r, c in enumerate(out.tolist()) if c != code]
        if bad:
            ranks = group_ranks(self.transport)
            raise ValueError(
                f"{self.name}: the replication group {ranks} does not match the mesh: "
                f"ranks {[ranks[r] for r in bad]} hold parameter shards of other shapes than "
                f"rank {ranks[self.rank]}. A replication group must join ranks that hold the "
                "same shard, i.e. lie along the mesh's 'replicate' dimension"
            )

    # ------------------------------------------------------------------ schedule
    def communicates(self, step: int) -> bool:
        """Whether this replicator exchanges data on ``step`` (0-based)."""
        if step % self.replicate_every:
            return False
        return not (self.skip_every and (step + 1) % self.skip_every == 0)

    # ------------------------------------------------------------------ running
    def __call__(self, grads: list[torch.Tensor | None], lrs: list[float],
                 step: int) -> list[torch.Tensor | None]:
        comm = self._begin(grads, step)
        try:
            return self.replicate(grads, lrs, step, comm)
        except NonFiniteGradientError as e:
            if self._withhold(step, comm):
                raise NonFiniteGradientError(self.name,
                                             [global_rank_of(self.transport, self.rank)],
                                             step, local=True) from e
            raise

    def _begin(self, grads: list[torch.Tensor | None], step: int) -> bool:
        """Checks and accounting at the start of a step; returns whether it exchanges."""
        shapes = self._local_shapes
        if len(grads) != len(shapes):
            raise ValueError(f"{self.name}: expected {len(shapes)} gradients, "
                             f"got {len(grads)}")
        self.stats.begin_step()
        comm = self.communicates(step) and self.world > 1
        if comm:
            self.stats.steps_replicated += 1
            if self._withheld is not None:
                mark_nonfinite(grads)
                self._withheld = None
        return comm

    def _withhold(self, step: int, comm: bool) -> bool:
        """After a non-finite input: whether only this rank knows of it (a step without
        exchange in a group of several). Then it skips the step alone, and under
        ``nonfinite="raise"`` its next exchange carries the flag so every rank raises there."""
        if comm or self.world <= 1:
            return False
        if self.nonfinite == "raise" and self._withheld is None:
            self._withheld = step
        return True

    @abstractmethod
    def replicate(self, grads: list[torch.Tensor | None], lrs: list[float], step: int,
                  communicate: bool) -> list[torch.Tensor | None]:
        """Return the replicated tensors (inputs may be overwritten and returned)."""

    # ------------------------------------------------------------------ two-phase use
    def start(self, grads: list[torch.Tensor | None], lrs: list[float], step: int):
        """Begin an exchange and return a handle for :meth:`finish`.

        Replicators that support it launch their collective asynchronously, so computation can
        go on until :meth:`finish`; the default runs the whole exchange here.
        """
        return self(grads, lrs, step)

    def finish(self, pending) -> list[torch.Tensor | None]:
        """Complete an exchange begun by :meth:`start`; returns the replicated tensors."""
        return pending

    def exchange_bytes(self) -> int:
        """Bytes this rank sends (and receives) in one exchange, by the ring formulas of
        :mod:`flexdemo.transport`; the default is an all-gather of :meth:`payload_bytes`."""
        return all_gather_bytes(self.payload_bytes(), self.world)

    def payload_bytes(self) -> int:
        """Bytes this rank contributes to one exchange."""
        raise NotImplementedError(f"{self.name} does not state its payload size")

    def after_step(self, step: int) -> None:  # noqa: B027 - optional hook
        """Called by the optimizer after the base optimizer's step ``step`` (override)."""

    def bad_peer(self, r: int, step: int, reason: str) -> None:
        """A peer's payload is bad: raise :class:`CorruptPayloadError` naming it
        (``on_bad_peer="raise"``), or count it in :attr:`dropped_payloads` and warn
        (``"drop"``); the caller leaves the payload out."""
        global_rank = global_rank_of(self.transport, r)
        if self.on_bad_peer == "raise":
            raise CorruptPayloadError(self.name, r, global_rank, step, reason)
        self.dropped_payloads += 1
        warnings.warn(f"{self.name}: dropped the payload of rank {global_rank} at step {step}: "
                      f"{reason}", RuntimeWarning, stacklevel=4)

    def clipped_contributions(self) -> int:
        """Peers' parts clipped to :attr:`bound` on this replica so far, its
        :meth:`inner_replicators`' included (reads the device where a clip was decided
        there)."""
        own = self.bound.clipped if self.bound is not None else 0
        return own + sum(p.clipped_contributions() for p in self.inner_replicators())

    # ------------------------------------------------------------------ contract
    @property
    def shapes(self) -> list[torch.Size] | None:
        """The rank-local parameter shapes it was set up for (None before :meth:`setup`)."""
        return self._shapes

    @property
    def _local_shapes(self) -> list[torch.Size]:
        """:attr:`shapes`, for code that runs after :meth:`setup` (raises before it)."""
        if self._shapes is None:
            raise RuntimeError(f"{self.name} is not set up; use it through flexdemo's optimizer")
        return self._shapes

    def inner_replicators(self) -> tuple[Replicator, ...]:
        """Replicators this one runs inside itself (none by default)."""
        return ()

    def keeps_replicas_identical(self, replicas: int) -> bool:
        """Whether this replicator keeps the parameters of ``replicas`` replicas bitwise
        identical at every step: by default when it :attr:`syncs_replicas`, exchanges on every
        step and its group spans them all. ``False`` when unsure (checkpoints then store base
        state and parameters per replica: safe, larger)."""
        return (self.syncs_replicas and self.replicate_every == 1 and self.skip_every == 0
                and self.world >= replicas)

    def tensor_state_keys(self) -> set[str]:
        """:attr:`state_tensor_keys` of this replicator and of its :meth:`inner_replicators`."""
        keys = set(self.state_tensor_keys)
        for p in self.inner_replicators():
            keys |= p.tensor_state_keys()
        return keys

    def reset_withheld(self) -> None:
        """Forget the non-finite step withheld for the next exchange (every rank of the
        group has learnt of it otherwise)."""
        self._withheld = None

    def shared_state(self) -> dict:
        """The part of the state that is equal on every replica, cloned (what a replica
        joining a running job fetches from a peer). None by default."""
        return {}

    def load_shared_state(self, state: dict) -> None:
        """Load a peer's :meth:`shared_state`; the per-replica rest starts from zero
        (:meth:`reset_replica_state`), and nothing is withheld."""
        self.reset_replica_state()
        self.reset_withheld()

    def sent_into(self, outs: list[torch.Tensor]) -> None:
        """What this rank sent in its last exchange, as its peers decode it, written into
        ``outs`` (tensors of its input shapes); replicators that can tell set
        :attr:`reports_sent` (DiLoCo's ``keep_unsent`` reads it)."""
        raise NotImplementedError(f"{self.name} cannot tell what it sent")

    def reset_replica_state(self) -> None:  # noqa: B027 - optional hook
        """Zero the per-replica state (e.g. error feedback: the part of this replica's own
        gradients not yet sent). Nothing by default."""

    def quorum_changed(self) -> None:
        """Under fault tolerance, before a step whose replicas are not those the last exchange
        went to (a replica left, joined or heals; also the first quorum): an exchange still in
        flight is dropped, never applied, and this replica's own part goes back into its
        per-replica state, so nothing is lost or counted twice. Every replica of the quorum
        does the same, so they stay identical. The :meth:`inner_replicators` are told; nothing
        else by default."""
        for p in self.inner_replicators():
            p.quorum_changed()

    def scaled_input_problem(self) -> str | None:
        """Why its mean cannot weigh inputs scaled per rank (:attr:`peer_scales`), one line,
        or None (a mean over all ranks, or one that reads :attr:`peer_scales`)."""
        return None

    def fault_tolerance_problem(self) -> str | None:
        """For a :attr:`fault_tolerant` replicator: why these settings cannot run under
        :mod:`flexdemo.ft` (one line), or None. Its :meth:`inner_replicators` are checked apart."""
        return None

    def enter_fault_tolerance(self) -> None:  # noqa: B027 - optional hook
        """Under :mod:`flexdemo.ft`, before set-up: take the settings' fault-tolerant form.
        Nothing by default."""

    def local_next_step(self) -> bool:
        """Under fault tolerance: whether the next step exchanges nothing and may run outside
        a quorum (no quorum, undo copy or commit vote). False by default."""
        return False

    def rebind(self) -> None:
        """Re-read the group's size and this rank (a quorum may change both) and rebuild
        what depends on them (:meth:`_group_resized`); state is kept."""
        world, rank = group_size(self.transport), group_rank(self.transport)
        if (world, rank) != (self.world, self.rank):
            self.world, self.rank = world, rank
            self.agreement = Agreement(self.name, rank, world, self.device, self.transport)
            self._group_resized()
        for p in self.inner_replicators():
            p.rebind()

    def _group_resized(self) -> None:  # noqa: B027 - optional hook
        """Rebuild buffers whose size depends on the group's size (override)."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"stats": self.stats.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load(state.get("stats", {}))

    def live_state(self) -> dict:
        """:meth:`state_dict` with the live tensors where it copies them (no allocation):
        fault tolerance's undo copy copies them once, into buffers it reuses every step.
        Valid until the next step; :meth:`load_state_dict` must accept a copy of it. A
        replicator whose ``state_dict`` clones overrides it (the default is ``state_dict``)."""
        return self.state_dict()

    def input_views(self) -> list[torch.Tensor] | None:
        """After set-up: the fp32 buffers its step copies its input into, one per tensor (None:
        it has none). A caller that builds its input there (DiLoCo's pseudo-gradients) saves
        that copy and one copy of the tensors' memory; the step then leaves them as it likes
        until its result is taken."""
        return None

    def state_tensors(self) -> list[torch.Tensor]:
        """The live tensors of the persistent state (what :meth:`state_dict` saves), for
        memory accounting; a replicator whose ``state_dict`` copies overrides it."""
        return [t for t in tree_leaves(self.state_dict()) if isinstance(t, torch.Tensor)]

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        sched = f"replicate_every={self.replicate_every}, skip_every={self.skip_every}"
        extra = self.extra_repr()
        return f"{type(self).__name__}({extra + ', ' if extra else ''}{sched})"

