"""CUDA graphs of DeMo's device work between the host's decisions, and the top-k selection
through ``torch.compile``. Both fall back to eager execution (with a warning) on failure."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from ...compress.select import select_rowmajor
from .layout import Group

WARM_CALLS = 2  # eager calls of a step shape before its CUDA graph is captured
MAX_SHAPES = 8  # step shapes beyond this many run eagerly (each has a graph per stage and group)


class StepGraphs:
    """CUDA graphs captured per key (a stage, the step's shape ``key[1]`` and what else
    tells the stage's graphs apart: a buffer, a group), replayed after. At most
    ``MAX_SHAPES`` step shapes are captured; every graph of a captured shape is kept (a
    cap on graphs rather than shapes left a step half graphed: delayed DeMo on a whole 124M
    model, two send buffers and 40 groups, ran a third of its step eagerly, 3.5x slower).

    ``on_failure()`` is called once when a capture fails (the owner then runs eagerly)."""

    def __init__(self, name: str, on_failure: Callable[[], None]) -> None:
        self.name, self.on_failure = name, on_failure
        self.captured: dict = {}  # key -> (graph, its outputs)
        self.warm: dict = {}  # key -> eager calls so far
        self.payloads: dict[int, torch.Tensor] = {}  # peers -> gathered payloads, fixed address
        self.shapes: set = set()  # the step shapes (key[1]) with a graph captured

    def run(self, key: tuple, fn):
        """``fn()`` through a CUDA graph captured for ``key``: the first ``WARM_CALLS`` calls
        of a key run eagerly (they allocate the scratch buffers), the next one captures (which
        runs nothing) and every call replays. Inputs and outputs are the replicator's own
        buffers and the graph's outputs, so their addresses hold. A failed capture warns once
        and the replicator runs eagerly from then on."""
        entry = self.captured.get(key)
        if entry is None:
            seen = self.warm.get(key, 0)
            shape = key[1] if len(key) > 1 else None
            if seen < WARM_CALLS or (shape not in self.shapes
                                     and len(self.shapes) >= MAX_SHAPES):
                self.warm[key] = seen + 1
                return fn()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    out = fn()
            except Exception as e:
                warnings.warn(f"{self.name}: capturing a CUDA graph failed ({e!r:.200}); "
                              "running eagerly", RuntimeWarning, stacklevel=3)
                self.on_failure()
                self.captured.clear()
                self.shapes.clear()
                return fn()
            entry = self.captured[key] = (graph, out)
            self.shapes.add(shape)
        entry[0].replay()
        return entry[1]

    def run_on_payloads(self, key: tuple, fn, gathered: torch.Tensor):
        """``fn(payloads)`` on ``gathered`` through a graph for ``key`` (and the number of
        peers): the payloads are first copied into a buffer of fixed address."""
        n = gathered.shape[0]
        static = self.payloads.get(n)
        if static is None:
            static = self.payloads[n] = torch.empty_like(gathered)
        static.copy_(gathered)
        return self.run(key + (n,), lambda: fn(static))


class CompiledSelection:
    """The top-k selection of a group's blocks through ``torch.compile`` (the same results
    as the eager selection). ``on_failure()`` is called once when compilation fails."""

    def __init__(self, name: str, on_failure: Callable[[], None]) -> None:
        self.name, self.on_failure = name, on_failure
        self.fn: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, g: Group):
        """``(indices, positions)`` of the top-k of every block of ``g``, or None: a block
        shape it does not cover, or compilation failed (the caller selects eagerly)."""
        cr, cc = g.chunk
        if cr % 8 or cr * cc // 8 < 4 * g.k:
            return None
        try:
            if self.fn is None:
                self.fn = torch.compile(select_rowmajor, dynamic=False)
            return self.fn(g.coef, g.k)
        except Exception as e:  # no compiler, an unsupported backend, ...
            warnings.warn(f"{self.name}: torch.compile of the selection failed ({e!r:.200}); "
                          "running it eagerly", RuntimeWarning, stacklevel=2)
            self.on_failure()
            return None
