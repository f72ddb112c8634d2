"""Exact memory accounting: live tensor bytes, counted per storage as tensors are created,
and the persistent state an optimizer keeps.

:class:`LiveBytes` is a dispatch mode: every tensor an operator returns under it is counted
once per storage until that storage is freed, so ``current`` is the bytes of tensors alive
now (created under the mode, or handed to :meth:`LiveBytes.track`) and ``peak`` the most
there were. It sees what the allocator would be asked for on any device, without the
allocator's rounding or caching, and without the process's other memory (RSS). It is a
measuring tool: it slows every operator a little, so it is not for production steps::

    with LiveBytes() as mem:
        model = build(); opt = ...                  # parameters counted as they are made
        loss_fn(model(x)).backward()
        start = mem.reset_peak()
        opt.step()
        workspace = mem.peak - start                # the step's transient bytes

An optimizer of flexdemo that steps under an active :class:`LiveBytes` records its step's
peak above the bytes live at its start in ``last_step_stats()["step_workspace_bytes"]``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "ReleasableStorages", "active", "reachable_tensors", "state_bytes",
           "storage_bytes"]

_ACTIVE: list[LiveBytes] = []


def _storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage, shared by every tensor viewing it (torch has no public
    name for it)."""
    return storage._cdata


def active() -> LiveBytes | None:
    """The innermost :class:`LiveBytes` in force, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s storage: itself, or a wrapper subclass's inner tensors
    (a DTensor's local shard)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t]
    names, _ = flatten(t)
    inner = (getattr(t, n) for n in names)
    return [x for i in inner if isinstance(i, torch.Tensor) for x in _plain_tensors(i)]


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages created under the mode (see the module's docstring).

    ``device``: count only storages on this device type (``"cpu"``, ``"cuda"``); None:
    every device."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.device = device
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[Any, int]] = {}  # storage key -> (weak ref, bytes)

    # ---------------------------------------------------------------- counting
    def track(self, tensors: Iterable[Any]) -> None:
        """Count tensors made before the mode was entered (parameters, a loaded state)."""
        for t in tree_leaves(list(tensors)):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        for x in _plain_tensors(t):
            if x.device.type == "meta" or (self.device and x.device.type != self.device):
                continue
            st = x.untyped_storage()
            key, nbytes = _storage_key(st), st.nbytes()
            seen = self._live.get(key)
            if seen is not None:
                if seen[1] == nbytes:
                    continue
                self.current -= seen[1]  # resized in place
            ref = weakref.ref(st, functools.partial(self._gone, key))
            self._live[key] = (ref, nbytes)
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def _gone(self, key: int, _ref: Any) -> None:
        """A counted storage was freed."""
        seen = self._live.pop(key, None)
        if seen is not None:
            self.current -= seen[1]

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Recount a counted storage whose size changed outside an operator (a
        :class:`ReleasableStorages` giving it back)."""
        seen = self._live.get(_storage_key(storage))
        if seen is not None:
            self.current += storage.nbytes() - seen[1]
            self._live[_storage_key(storage)] = (seen[0], storage.nbytes())
            self.peak = max(self.peak, self.current)

    def reset_peak(self) -> int:
        """Start a new peak at the bytes live now; returns them."""
        self.peak = self.current
        return self.current

    # ---------------------------------------------------------------- the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)


def storage_bytes(tree: Any, device: str | None = None) -> int:
    """Bytes of the distinct storages of the tensors in ``tree`` (nested dicts, lists,
    tuples; DTensors by their local shard), each storage counted once."""
    seen: dict[int, int] = {}
    for t in tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        for x in _plain_tensors(t):
            if x.device.type == "meta" or (device and x.device.type != device):
                continue
            st = x.untyped_storage()
            seen[_storage_key(st)] = st.nbytes()
    return sum(seen.values())


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The persistent state an optimizer keeps: bytes of the tensors reachable from its
    ``state_dict()``, each storage counted once (copies it makes for the dict count as the
    state they copy)."""
    return storage_bytes(optimizer.state_dict())


def reachable_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors reachable from ``obj`` through dicts, lists, tuples and the attributes of
    flexdemo's own objects (a replicator's buffers, layouts, scratch), each object once."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
            continue
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif type(x).__module__.startswith("flexdemo") and hasattr(x, "__dict__"):
            todo.extend(vars(x).values())
    return out


class ReleasableStorages:
    """Scratch buffers that can be given back between uses while every view made of them
    stays valid: :meth:`release` resizes their storages to nothing, :meth:`restore` gives
    each its bytes back, zeroed as when it was made. For buffers an exchange needs only
    every H steps (a DiLoCo sync), which would otherwise be held between uses. Not for
    buffers captured by a CUDA graph (a restored storage has a new address)."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for t in tensors:
            st = t.untyped_storage()
            storages[_storage_key(st)] = (st, st.nbytes())
        self._storages = list(storages.values())
        self.released = False

    @property
    def nbytes(self) -> int:
        """The bytes the storages hold when in use."""
        return sum(n for _, n in self._storages)

    def release(self) -> None:
        """Free every storage (its views keep their shapes and strides)."""
        if self.released:
            return
        for st, _ in self._storages:
            st.resize_(0)
            for mem in _ACTIVE:
                mem.resized(st)
        self.released = True

    def restore(self) -> None:
        """Give every storage its bytes back, zeroed; a no-op unless released."""
        if not self.released:
            return
        for st, n in self._storages:
            st.resize_(n)
            for mem in _ACTIVE:
                mem.resized(st)
            torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).zero_()
        self.released = False
