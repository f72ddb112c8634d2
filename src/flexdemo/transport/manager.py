"""A transport over a torchft Manager's reconfigurable process group.

Its size and rank are those of the current quorum (set by :class:`~flexdemo.ft.session.
ElasticSession` after each one); before the first quorum it is a group of one. Collectives run
on the process group the Manager reconfigures at each quorum; a failure is reported to the
Manager (``wrap_future``), so the step's commit vote fails, and raised here as
:class:`PeerLostError` so the step stops at once.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
)

from .core import PeerLostError, Transport

__all__ = ["ManagerTransport"]


class _Handle:
    """An in-flight collective: ``wait()`` completes it or raises :class:`PeerLostError`."""

    def __init__(self, transport: ManagerTransport, fut, what: str) -> None:
        self.transport, self.fut, self.what = transport, fut, what

    def wait(self) -> bool:
        ok = self.fut.wait()
        self.transport.check(self.what)
        return bool(ok)


class ManagerTransport(Transport):
    """The replicate dimension under fault tolerance: this rank and the same rank of every
    other replica group in the current quorum."""

    def __init__(self, manager, pg, timeout: float) -> None:
        self.manager, self.pg = manager, pg  # pg: the process group the Manager reconfigures
        self.timeout = timedelta(seconds=timeout)
        self.size, self.rank = 1, 0

    def set_quorum(self, size: int, rank: int) -> None:
        """The participants of the step about to run, and this group's place among them."""
        self.size, self.rank = int(size), int(rank)

    def global_rank(self, r: int) -> int:
        return r

    def check(self, what: str) -> None:
        """Raise :class:`PeerLostError` if the Manager has recorded an error this step."""
        err = self.manager.errored()
        if err is not None:
            first = str(err.original_exception).strip().splitlines()
            raise PeerLostError(f"{what} over the fault-tolerant group failed: "
                                f"{first[0] if first else type(err.original_exception).__name__}")

    def _run(self, launch, what: str, async_op: bool):
        self.check(what)
        try:
            work = launch()
            fut = self.manager.wrap_future(work.get_future(), False, timeout=self.timeout)
        except Exception as e:  # a broken group: the Manager votes no
            self.manager.report_error(e)
            self.check(what)
            raise
        handle = _Handle(self, fut.then(lambda f: f.value() is not False), what)
        if async_op:
            return handle
        handle.wait()
        return None

    def all_reduce_sum_(self, buf: torch.Tensor, async_op: bool = False):
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # stubs: RedOpType
        pg = self.pg
        return self._run(lambda: pg.allreduce([buf], opts), "all-reduce", async_op)

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        flat = inp.reshape(-1)
        rows = list(out.view(self.size, flat.numel()).unbind(0))
        pg = self.pg
        return self._run(lambda: pg.allgather([rows], [flat], AllgatherOptions()),
                         "all-gather", async_op)

    def all_to_all_equal_(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        pg = self.pg
        return self._run(lambda: pg.alltoall_base(out.view(-1), inp.view(-1), [], [],
                                                  AllToAllOptions()), "all-to-all", async_op)

    def __deepcopy__(self, memo) -> ManagerTransport:
        return self

    def __repr__(self) -> str:
        return f"ManagerTransport(rank={self.rank}, size={self.size})"
