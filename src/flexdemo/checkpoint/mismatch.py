"""What differs between a checkpoint and the job that loads it, said the same way on every
path (flexdemo's own checkpoints and torch's DCP helpers): :class:`CheckpointMismatchError`
with one line naming the saved value against the new one."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = ["CheckpointMismatchError", "check_base", "check_mesh", "check_model",
           "check_replicators", "setting_differences"]


class CheckpointMismatchError(ValueError):
    """A checkpoint that this job cannot resume: it was written with another mesh, model,
    base optimizer or replicators. ``differences`` lists ``(what, saved, now)``."""

    def __init__(self, message: str, differences: list[tuple[str, str, str]]) -> None:
        super().__init__(message)
        self.differences = differences

    def __reduce__(self):
        return type(self), (str(self), self.differences)


def setting_differences(saved: str, now: str) -> list[tuple[str, str, str]]:
    """The ``key=value`` settings that differ between two reprs such as
    ``DeMoReplicator(topk=16, chunk=64)``; the whole reprs if the kinds differ."""
    pattern = re.compile(r"^(\w+)\((.*)\)$")
    ms, mn = pattern.match(saved), pattern.match(now)
    if not (ms and mn) or ms.group(1) != mn.group(1):
        return [("kind", saved, now)]

    def pairs(text: str) -> dict[str, str]:
        out = {}
        for part in re.split(r",\s*(?=\w+=)", text):
            if "=" in part:
                k, v = part.split("=", 1)
                out[k.strip()] = v.strip()
        return out

    a, b = pairs(ms.group(2)), pairs(mn.group(2))
    diff = [(k, a.get(k, "(unset)"), b.get(k, "(unset)")) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
    return diff or [("kind", saved, now)]


def check_mesh(path: object, saved_world: int, saved_mesh: Sequence[int], world: int,
               mesh: Sequence[int], *, replicas_may_change: bool = False) -> None:
    """The world size and ``(replicate, shard)`` mesh that wrote ``path`` against this job's.
    With ``replicas_may_change``, another number of replicas of the same shard size passes
    (:func:`flexdemo.load_checkpoint` regroups them)."""
    saved_mesh, mesh = tuple(saved_mesh), tuple(mesh)
    if saved_world == world and saved_mesh == mesh:
        return
    if (replicas_may_change and saved_mesh[1] == mesh[1]
            and saved_world == saved_mesh[0] * saved_mesh[1] and world == mesh[0] * mesh[1]):
        return
    if saved_mesh[1] != mesh[1]:
        what = ("Each rank's shards and per-replica state (DeMo momentum, replicator buffers, "
                "DiLoCo copies, the data position in `extra`) cannot be regrouped into another "
                f"shard size: resume with shard={saved_mesh[1]}, e.g. flexdemo.prepare(..., "
                f"replicate={saved_mesh[0]}, shard={saved_mesh[1]})")
    else:
        what = ("Per-replica state (DeMo momentum, replicator buffers, DiLoCo copies, the data "
                "position in `extra`) is not redistributed on this path: resume with the same "
                f"mesh, e.g. flexdemo.prepare(..., replicate={saved_mesh[0]}, "
                f"shard={saved_mesh[1]}), or save with flexdemo.save_checkpoint, whose "
                "load_checkpoint resumes on another number of replicas")
    raise CheckpointMismatchError(
        f"checkpoint {path} was written by {saved_world} rank(s) as a replicate x "
        f"shard = {saved_mesh[0]} x {saved_mesh[1]} mesh, but this job runs {world} rank(s) "
        f"as {mesh[0]} x {mesh[1]}. {what}",
        [("world size", str(saved_world), str(world)),
         ("mesh", f"{saved_mesh[0]} x {saved_mesh[1]}", f"{mesh[0]} x {mesh[1]}")])


def check_model(path: object, saved: Mapping[str, Sequence[int]],
                now: Mapping[str, Sequence[int]]) -> None:
    """The model's tensor names and (global) shapes in ``path`` against this model's."""
    missing = sorted(set(saved) - set(now))
    unexpected = sorted(set(now) - set(saved))
    shapes = [f"{k} {tuple(saved[k])} -> {tuple(now[k])}"
              for k in sorted(set(saved) & set(now)) if tuple(saved[k]) != tuple(now[k])]
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, items in (("missing from this model", missing),
                         ("not in the checkpoint", unexpected),
                         ("with another shape (saved -> this model)", shapes)):
        if items:
            more = f" and {len(items) - 5} more" if len(items) > 5 else ""
            parts.append(f"{label}: {', '.join(items[:5])}{more}")
    raise CheckpointMismatchError(
        f"checkpoint {path} was written for another model; tensors {'; '.join(parts)}. "
        "Load it into the model it was saved from (same architecture and parameter names)",
        [("model", f"{len(saved)} tensors", f"{len(now)} tensors" + (
            f" ({shapes[0]}{' ...' if len(shapes) > 1 else ''})" if shapes else ""))])


def check_base(path: object, saved: str, now: str) -> None:
    """The base optimizer's class name in ``path`` against this optimizer's."""
    if saved != now:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds {saved} state, this optimizer's base is {now}; build the "
            "optimizer with the same base optimizer to resume", [("base optimizer", saved, now)])


def check_replicators(path: object, saved: list[str], mine: list[str]) -> None:
    """The replicators' reprs (kind and settings) in ``path`` against this optimizer's."""
    if saved == mine:
        return
    diff: list[tuple[str, str, str]] = []
    if len(saved) != len(mine):
        diff.append(("replicators", str(saved), str(mine)))
    else:
        for i, (a, b) in enumerate(zip(saved, mine)):
            tag = "replicator" if len(mine) == 1 else f"replicator {i}"
            diff += [(f"{tag} {k}" if k != "kind" else tag, x, y)
                     for k, x, y in setting_differences(a, b) if a != b]
    said = ", ".join(f"{w} {x} (now {y})" for w, x, y in diff)
    raise CheckpointMismatchError(
        f"checkpoint {path} was written with replicators {saved}, this optimizer has {mine} "
        f"({said}); build the optimizer with the same replicators to resume", diff)
