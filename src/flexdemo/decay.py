"""Which parameters get no weight decay: the usual rule for norms and biases.

``prepare(..., no_decay=True)`` (and ``DeToNATION(..., no_decay=...)``) gives these
parameters a weight decay of 0, whichever decay is set: ``prepare()``'s decoupled
``weight_decay=`` and the base optimizer's own (``optimizer_kwargs={"weight_decay": ...}``,
AdamW's or both parts of Muon's). The default rule (:func:`is_no_decay`,
:func:`no_decay_names`):

* every parameter with fewer than 2 dimensions (biases, norm scales and shifts);
* every parameter of a normalisation module, found by module type (:data:`NORM_TYPES`);
* a parameter whose dotted name ends in ``bias``, or has a part naming a norm (containing
  ``norm``, e.g. ``LayerNorm``, ``layer_norm``, ``norm1``; or ``ln`` / ``ln_*``, GPT-2's
  ``ln_1``, ``ln_f``).

Embeddings and the output head keep their decay (as in nanoGPT and Hugging Face's Trainer).
``no_decay=[names]`` or ``no_decay=lambda name, p: ...`` replaces the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

__all__ = ["NORM_TYPES", "is_no_decay", "no_decay_flags", "no_decay_names"]

#: module types whose parameters get no weight decay under the default rule
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)

NoDecay = bool | Callable[[str, torch.Tensor], bool] | Collection[str] | None


def is_no_decay(name: str | None, param: torch.Tensor) -> bool:
    """The default rule without module types: fewer than 2 dimensions, or a dotted name that
    ends in ``bias`` or has a part naming a norm (``*norm*``, ``ln``, ``ln_*``). Without a
    name (``None``), the dimensions alone decide."""
    if param.ndim < 2:
        return True
    if name is None:
        return False
    parts = name.lower().split(".")
    return parts[-1] == "bias" or any("norm" in p or p == "ln" or p.startswith("ln_")
                                      for p in parts)


def no_decay_names(model: nn.Module) -> list[str]:
    """The parameters of ``model`` that get no weight decay under the default rule:
    :func:`is_no_decay`, and every parameter of a module in :data:`NORM_TYPES`."""
    normed = {id(p) for m in model.modules() if isinstance(m, NORM_TYPES)
              for p in m.parameters(recurse=False)}
    return [n for n, p in model.named_parameters() if id(p) in normed or is_no_decay(n, p)]


def no_decay_flags(no_decay: NoDecay, pairs: list[tuple[str | None, torch.Tensor]]
                   ) -> list[bool]:
    """For each ``(name, param)`` of ``pairs`` (names may be None), whether it gets no weight
    decay: ``no_decay`` is False/None (none), True (:func:`is_no_decay`), a rule
    ``(name, param) -> bool`` or a collection of parameter names (both need names)."""
    if no_decay is None or no_decay is False:
        return [False] * len(pairs)
    if no_decay is True:
        return [is_no_decay(n, p) for n, p in pairs]
    named = all(n is not None for n, _ in pairs)
    if callable(no_decay) or (isinstance(no_decay, Collection)
                              and not isinstance(no_decay, str)):
        if not named:
            raise ValueError("no_decay as a rule or a list of names needs named parameters: "
                             "pass model.named_parameters() (prepare() does)")
        if callable(no_decay):
            rule = no_decay
            return [bool(rule(str(n), p)) for n, p in pairs]
        chosen = set(no_decay)
        unknown = sorted(chosen - {n for n, _ in pairs})
        if unknown:
            raise ValueError(f"no_decay names parameters the model does not have: "
                             f"{unknown[:4]}; use names from model.named_parameters()")
        return [n in chosen for n, _ in pairs]
    raise TypeError(f"no_decay must be True/False, a rule(name, param) -> bool or a list of "
                    f"parameter names, got {type(no_decay).__name__}")
