"""A seed stack's step sizes: each seed's own schedule, in one optimizer over the stacked weights.

A method sets its schedule's values in ``prepare_step(optimizer)`` (the optimizer's param groups). Where they
depend on the seed (gradient features' first step, ``eta^(1)``, is set from each seed's own data and
initialisation), one optimizer for the stacked weights needs one value per seed: the stack asks every member
and, where they differ, gives the group a tuple with seed s's value in row s, for an optimizer that takes
them (``per_row_values = True``: :class:`~featlearn.lightning_modules.two_layer_parts.ScheduledGD`). Any other
optimizer is refused with a message naming ``--seeds``.

Example:
    >>> import torch
    >>> from types import SimpleNamespace
    >>> class Member:
    ...     def __init__(self, lr): self.lr = lr
    ...     def prepare_step(self, optimizer):
    ...         for group in optimizer.param_groups: group["lr"] = self.lr
    >>> optimizer = SimpleNamespace(param_groups=[{"params": [], "lr": 0.0}], per_row_values=True)
    >>> prepare_seeds([Member(0.5), Member(0.25)], optimizer, [0, 1])
    >>> group, = optimizer.param_groups
    >>> group["lr"]
    (0.5, 0.25)
"""
from __future__ import annotations

from types import SimpleNamespace

from featlearn.errors import ConfigError
from featlearn.lightning_modules.base import FeatureLearningModule


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements: the same object or not
        return False


def prepare_seeds(members: list, optimizer, seeds: list[int]) -> None:
    """Every member's ``prepare_step`` on the stack's ``optimizer``: one value per group entry where the seeds
    agree, a tuple (row s: seed s) where they do not (module docstring)."""
    first = members[0]
    first.prepare_step(optimizer)
    if len(members) == 1 or type(first).prepare_step is FeatureLearningModule.prepare_step:
        return  # no schedule (the base hook does nothing)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    frozen = [p.requires_grad for p in params]  # a schedule may freeze a layer: one leaf holds every seed's
    shadows = []
    for member in members[1:]:  # each on copies of the groups, the same entries as the first member's
        shadow = SimpleNamespace(param_groups=[dict(group) for group in optimizer.param_groups])
        member.prepare_step(shadow)
        shadows.append(shadow.param_groups)
        if [p.requires_grad for p in params] != frozen:
            raise ConfigError("seeds", f"seeds whose {type(first).__name__} schedules freeze the same weights at "
                                       "each step; train its seeds one run each", seeds)
    inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper holds the torch optimizer
    for i, group in enumerate(optimizer.param_groups):
        for key, value in list(group.items()):
            values = [value, *(groups[i][key] for groups in shadows)]
            if key == "params" or all(_same(v, value) for v in values[1:]):
                continue
            if not getattr(inner, "per_row_values", False):
                raise ConfigError("seeds", f"seeds whose {type(first).__name__} schedules agree: {key!r} differs "
                                           f"between the seeds ({values}) and {type(inner).__name__} takes one "
                                           "value per group; train its seeds one run each", seeds)
            group[key] = tuple(values)
