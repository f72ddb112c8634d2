"""N replicas of a model trained in one process on one device, exchanging through memory.

:class:`SimulatedReplicas` builds N copies of a model (the same initial weights) and N
optimizers whose replicators talk over an :class:`~flexdemo.transport.InProcessHub` instead of
the network: the same replicators, codecs and byte accounting as a run with N processes, and
the same bits as N gloo processes (DeMo and every other all-gather exchange decode in rank
order; all-reduce sums in gloo's ring order, see :func:`flexdemo.transport.ring_sum_`).

A step runs every replica's forward and backward one after the other in the calling thread,
each with its own random-number state (dropout draws what it would draw in its own process),
then every replica's optimizer step in its own thread, because the replicators' collectives
block until all replicas arrive. Torch releases the GIL in its kernels, so the steps overlap
where the hardware allows. A replica that raises ends the step on every replica: the others'
pending collectives are aborted and the step raises the failing replica's exception; a replica
stuck for ``timeout`` seconds ends it with :class:`SimulationError`.

Replicas of different speeds (DiLoCo's ``pace=``, :mod:`flexdemo.replicate.pace`): a replica
syncs after its own number of inner steps, so a step advances only the replicas that have
steps left before their sync (:meth:`SimulatedReplicas.stepping`); a replica whose next step
is its sync waits until every replica's is, and then all take it together. Each replica's
own steps are those it takes in its own process; without a pace, or with equal counts,
every replica steps every time (lockstep, the bits as before).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .muon import with_model_rule
from .optim import DeToNATION
from .replicate import Replicator, make_replicator
from .sharding import target_device
from .transport import InProcessHub, InProcessTransport, ReplicaAbortedError


class SimulationError(RuntimeError):
    """A simulated step could not complete on every replica (a stuck or aborted replica)."""


def run_replicas(hub: InProcessHub, fn: Callable[[int], object]) -> list:
    """Run ``fn(rank)`` for every replica of ``hub``, each in its own thread; their results.

    If some replica raises, the others' collectives are aborted and the lowest such replica's
    exception is raised here (with a note naming the replica). A replica that does not finish
    within the hub's timeout (plus a grace period) raises :class:`SimulationError`; its thread
    is left behind (a daemon) and the hub must not be used again.
    """
    n = hub.world
    hub.reset()
    results: list = [None] * n
    errors: list[BaseException | None] = [None] * n

    def target(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # reported by the caller's thread
            errors[r] = e
            hub.abort(f"replica {r} failed: {type(e).__name__}: {e}")
        else:
            hub.leave(r)

    threads = [threading.Thread(target=target, args=(r,), name=f"flexdemo-replica-{r}",
                                daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(hub.timeout + 30.0)
    except BaseException:
        hub.abort("the simulation was interrupted")
        raise
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        hub.abort(f"replica(s) {stuck} did not finish")
        raise SimulationError(
            f"simulated replica(s) {stuck} did not finish their work within {hub.timeout:g} s "
            "(a hang outside the collectives); the simulation can not go on")
    failed = [r for r, e in enumerate(errors) if e is not None
              and not isinstance(e, ReplicaAbortedError)]
    if failed:
        err = errors[failed[0]]
        assert err is not None
        others = f"; replicas {failed} raised" if len(failed) > 1 else ""
        if hasattr(err, "add_note"):
            err.add_note(f"raised by simulated replica {failed[0]} of {n}{others}")
        raise err
    aborted = [r for r, e in enumerate(errors) if e is not None]
    if aborted:
        raise SimulationError(f"simulated step failed on replica(s) {aborted}: "
                              f"{errors[aborted[0]]}") from errors[aborted[0]]
    return results


def _without_graphs(reps, device: torch.device) -> None:
    """Replicas share one stream from several threads, which a CUDA graph's capture cannot:
    ``graphs="auto"`` is turned off (also inside composite replicators), ``True`` refused."""
    todo = [r for r in reps if isinstance(r, Replicator)]
    while todo:
        rep = todo.pop()
        graphs = getattr(rep, "graphs", None)
        if graphs == "auto":
            rep.graphs = False  # type: ignore[attr-defined]  # replicators that have graphs
        elif graphs is True and device.type == "cuda":
            raise ValueError(f"{rep.name}: graphs=True cannot run under SimulatedReplicas (its "
                             "replicas share one CUDA stream from several threads); leave "
                             "graphs at 'auto' or set it to False")
        for v in vars(rep).values():  # composite replicators: their parts
            parts = v if isinstance(v, (list, tuple)) else [v]
            todo.extend(p for p in parts if isinstance(p, Replicator))


def _fresh_replicators(spec) -> list:
    """One replica's replicators: names stay names; unused instances are deep-copied."""
    if callable(spec) and not isinstance(spec, Replicator):
        spec = spec()
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    out = []
    for s in specs:
        if isinstance(s, Replicator):
            if s.shapes is not None:
                raise ValueError(f"{s.name}: the replicator is already in use; pass an unused "
                                 "instance (each replica gets its own copy) or a name")
            if s.group is not None:
                raise ValueError(f"{s.name}: a simulated replicator exchanges over the "
                                 "simulation's group; construct it without group=")
            s = copy.deepcopy(s)
        out.append(s)
    return out


def _steps_left(opt) -> int | None:
    """A replica's inner steps left up to its next sync under a pace (DiLoCo's ``pace=``,
    the first of its replicators that has one), or None without."""
    for rep in getattr(opt, "replicators", []):
        pace = getattr(rep, "pace", None)
        if pace is not None and getattr(pace, "fill", False):
            raise ValueError("pace='fill' lets the faster replicas take steps until the "
                             "slowest arrives, and SimulatedReplicas runs the replicas in "
                             "one process: use pace='adaptive' (or given counts) in a "
                             "simulation")
        if pace is not None and getattr(pace, "timed", False):
            raise ValueError("pace='timed' ends each replica's period on its own clock, and "
                             "SimulatedReplicas runs the replicas in one process: use "
                             "pace='adaptive' (or given counts) in a simulation")
        if pace is not None:
            return int(pace.count - pace.since)
    return None


class SimulatedReplicas:
    """N replicas of ``model`` trained with flexdemo's optimizer in one process.

    Args:
        model: a module (copied N times) or a factory ``() -> nn.Module`` (called once, then
            copied), so all replicas start from the same weights.
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` of one replica on its batch.
        replicas: number of replicas N.
        replicator: as for :class:`~flexdemo.DeToNATION`: a name, an unused instance (every
            replica gets a deep copy) or a list of them; or a factory returning them.
        optimizer: the base optimizer (name or factory), ``lr`` its learning rate;
            ``replicator_kwargs`` go to a replicator given by name; other keyword arguments
            (``weight_decay``, ``nonfinite``, ``base_kwargs``) go to ``DeToNATION``.
        optimizer_fn: instead of the above, ``optimizer_fn(params, group) -> Optimizer`` builds
            one replica's optimizer over ``group`` (e.g. ``flexdemo.DeMo(params, lr=...,
            process_group=group)``).
        device: where the replicas live (default: where ``model`` is); all on one device.
        seed: replica ``r``'s random numbers start from ``torch.manual_seed(seed + r)``; with
            ``None`` every replica starts from the process's current random state.
        timeout: seconds a replica may wait for the others in a collective.
    """

    def __init__(self, model: nn.Module | Callable[[], nn.Module],
                 loss_fn: Callable[[nn.Module, object], torch.Tensor], *, replicas: int,
                 replicator="demo", optimizer: str | Callable = "sgd", lr: float = 1e-3,
                 replicator_kwargs: dict | None = None,
                 optimizer_fn: Callable[[list, InProcessTransport], torch.optim.Optimizer]
                 | None = None, device: torch.device | str | None = None,
                 seed: int | None = None, timeout: float = 300.0, **optimizer_kwargs) -> None:
        self.hub = InProcessHub(replicas, timeout)
        self.n = replicas
        base = model() if not isinstance(model, nn.Module) and callable(model) else model
        if not isinstance(base, nn.Module):
            raise TypeError(f"model must be an nn.Module or a factory of one, got "
                            f"{type(base).__name__}")
        self.loss_fn = loss_fn
        self.models = [copy.deepcopy(base) for _ in range(replicas)]
        if device is not None:
            device = target_device(torch.device("cpu"), device)  # one line if unusable
            self.models = [m.to(device) for m in self.models]
        first = next(self.models[0].parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.groups = [self.hub.transport(r) for r in range(replicas)]
        self._rng = [self._initial_rng(seed, r) for r in range(replicas)]
        if replicator_kwargs and not isinstance(replicator, str):
            raise ValueError("replicator_kwargs go with a replicator given by name")

        def build(r: int) -> torch.optim.Optimizer:
            model = self.models[r]
            if optimizer_fn is not None:
                return optimizer_fn(list(model.parameters()), self.groups[r])
            reps = ([make_replicator(replicator, **replicator_kwargs)] if replicator_kwargs
                    else _fresh_replicators(replicator))
            reps = [make_replicator(r) if isinstance(r, str) else r for r in reps]
            _without_graphs(reps, self.device)
            kw = dict(optimizer_kwargs)
            kw["base_kwargs"] = with_model_rule(model, optimizer, kw.get("base_kwargs"))
            return DeToNATION(list(model.named_parameters()), reps, base=optimizer, lr=lr,
                              group=self.groups[r], **kw)

        self.optimizers: list[torch.optim.Optimizer] = self.run(build)
        for opt in self.optimizers:  # optimizers of optimizer_fn (already set up)
            _without_graphs(getattr(opt, "replicators", []), self.device)
            for rep in getattr(opt, "replicators", []):  # "auto" serves this optimizer
                if hasattr(rep, "bind_optimizer"):
                    rep.bind_optimizer(opt)
        self._losses: list[torch.Tensor | None] = [None] * replicas  # each one's last

    # ------------------------------------------------------------------ random numbers
    def _initial_rng(self, seed: int | None, r: int) -> tuple:
        if seed is None:
            return self._get_rng()
        outer = self._get_rng()
        torch.manual_seed(seed + r)
        state = self._get_rng()
        self._set_rng(outer)
        return state

    def _get_rng(self) -> tuple:
        cuda = (torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        return torch.get_rng_state(), cuda

    def _set_rng(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextmanager
    def replica_rng(self, r: int):
        """Run the enclosed code with replica ``r``'s random-number state (and keep it)."""
        outer = self._get_rng()
        self._set_rng(self._rng[r])
        try:
            yield
        finally:
            self._rng[r] = self._get_rng()
            self._set_rng(outer)

    # ------------------------------------------------------------------ stepping
    def run(self, fn: Callable[[int], object]) -> list:
        """Run ``fn(r)`` for every replica ``r`` in its own thread (see :func:`run_replicas`).

        On a GPU the threads issue their kernels on the caller's current stream, so they run
        in order after the forward and backward passes and after each other's deposits.
        """
        if self.device.type != "cuda":
            return run_replicas(self.hub, fn)
        stream = torch.cuda.current_stream(self.device)

        def on_stream(r: int):
            with torch.cuda.stream(stream):
                return fn(r)
        return run_replicas(self.hub, on_stream)

    def stepping(self) -> list[bool]:
        """Which replicas take the next :meth:`step`: every one, unless a pace (DiLoCo's
        ``pace=``) leaves replicas different numbers of steps before their sync; then those
        with steps left before it, or every one when each has its sync left alone."""
        left = [_steps_left(opt) for opt in self.optimizers]
        if any(k is None for k in left):
            return [True] * self.n
        if all(k == 1 for k in left):
            return [True] * self.n  # every replica's sync: together
        return [k is not None and k > 1 for k in left]

    def backward(self, batches: Sequence,
                 stepping: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """Forward and backward of every replica (of those ``stepping``, default all) on its
        own batch; the detached losses (a replica left out: its last loss, NaN before its
        first)."""
        if len(batches) != self.n:
            raise ValueError(f"step needs one batch per replica: got {len(batches)} batches "
                             f"for {self.n} replicas")
        losses = []
        for r, (model, b) in enumerate(zip(self.models, batches)):
            if stepping is not None and not stepping[r]:
                last = self._losses[r]
                losses.append(torch.full((), float("nan"), device=self.device)
                              if last is None else last)
                continue
            with self.replica_rng(r):
                loss = self.loss_fn(model, b)
                loss.backward()
            self._losses[r] = loss.detach()
            losses.append(loss.detach())
        return losses

    def optimizer_step(self, stepping: Sequence[bool] | None = None) -> None:
        """Every replica's (of those ``stepping``, default all) optimizer step (the exchange
        included) and ``zero_grad`` (also after a step that raised, e.g.
        ``NonFiniteGradientError``: the next step starts from fresh gradients)."""
        def one(r: int) -> None:
            if stepping is not None and not stepping[r]:
                return
            try:
                self.optimizers[r].step()
            finally:
                self.optimizers[r].zero_grad()
        self.run(one)

    def step(self, batches: Sequence) -> list[torch.Tensor]:
        """One training step of every replica on its batch; the losses (detached tensors).
        Under a pace only the replicas :meth:`stepping` names step (the others' batches are
        not read; each of them gives its last loss again, NaN before its first)."""
        stepping = self.stepping()
        losses = self.backward(batches, stepping)
        self.optimizer_step(stepping)
        return losses

    def train(self, steps: int, batches: Callable[[int], Sequence],
              lr: Callable[[int], float] | None = None,
              on_step: Callable[[int, list[torch.Tensor]], bool | None] | None = None
              ) -> int:
        """The training loop: for ``step`` in ``0 .. steps - 1`` set every optimizer's lr to
        ``lr(step)`` (when given), take :meth:`step` on ``batches(step)`` (one batch per
        replica), then call ``on_step(step + 1, losses)``; a true result stops the loop.
        Returns the steps taken (under a pace, steps of the simulation: a replica that waits
        for its sync takes none, :meth:`stepping`). ``flexdemo simulate`` and
        ``benchmarks/quality.py`` both train through it."""
        done = 0
        for step in range(steps):
            if lr is not None:
                value = lr(step)
                for opt in self.optimizers:
                    for group in opt.param_groups:
                        group["lr"] = value
            losses = self.step(batches(step))
            done = step + 1
            if on_step is not None and on_step(done, losses):
                break
        return done

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Every replica's model, optimizer and random-number state (references, not copies)."""
        return {"replicas": [{"model": m.state_dict(), "optimizer": o.state_dict(), "rng": rng}
                             for m, o, rng in zip(self.models, self.optimizers, self._rng)]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` of a simulation with as many replicas."""
        reps = state["replicas"]
        if len(reps) != self.n:
            raise ValueError(f"the state holds {len(reps)} replicas, this simulation {self.n}; "
                             "build it with replicas=" + str(len(reps)))
        def load(r: int) -> None:  # every replica at once, as ranks load (a replicator may
            self.models[r].load_state_dict(reps[r]["model"])  # talk to its group: "auto")
            self.optimizers[r].load_state_dict(reps[r]["optimizer"])
            self._rng[r] = tuple(reps[r]["rng"])
        self.run(load)

    # ------------------------------------------------------------------ inspection
    def identical(self) -> bool:
        """Whether every replica's parameters are bitwise equal to replica 0's."""
        ref = [p.detach() for p in self.models[0].parameters()]
        return all(torch.equal(a, b.detach()) for m in self.models[1:]
                   for a, b in zip(ref, m.parameters()))

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each replica has sent over all steps (as it would over the network)."""
        return [getattr(o, "bytes_sent", 0) for o in self.optimizers]

    @property
    def bytes_received(self) -> list[int]:
        return [getattr(o, "bytes_received", 0) for o in self.optimizers]

    def last_step_stats(self) -> list[dict]:
        """Each replica's ``last_step_stats()`` (bytes and collectives of the last step)."""
        # flexdemo's optimizers (an optimizer_fn's optimizer may lack it: AttributeError)
        return [o.last_step_stats() for o in self.optimizers]  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return (f"SimulatedReplicas(replicas={self.n}, device={self.device}, "
                f"optimizer={self.optimizers[0]!r})")
