"""Contrastive regularisation (Shi 2024, Eq. 7.9 and Prop F.9): a piece any contrastive module uses.

Two parts, usable together or apart:

* the objective ``supervised + lam * contrastive`` (:meth:`ContrastiveRegularization.loss`): the method of the
  dissertation (cross-entropy or squared loss on the labels, plus the method's own contrastive loss on
  augmented views of the labelled inputs);
* the trust region ``||theta - theta*||_F <= gamma`` around reference parameters ``theta*`` (the pretrained
  representation), applied after each optimisation step (:meth:`ContrastiveRegularization.project_`). The
  norm is the Frobenius norm of all the watched parameters together. Prop F.9 is the trust region alone
  (``lam`` irrelevant, no labels): fine-tuning the universal representation by contrastive learning on the
  target task, which raises the target's private features to ``min(1, sqrt(1/T) + gamma / sqrt(r - s))``
  while keeping everything else.

A module keeps one :class:`ContrastiveRegularization` (an ``nn.Module``: the reference follows the module's
device and is saved in its checkpoints), calls :meth:`~ContrastiveRegularization.anchor` once with the
parameters to watch, and :meth:`~ContrastiveRegularization.project_` in its ``finish_step``.

Example:
    >>> w = torch.nn.Parameter(torch.zeros(2, 2))
    >>> cr = ContrastiveRegularization(lam=0.5, gamma=1.0).anchor({"w": w})
    >>> with torch.no_grad():
    ...     _ = w.add_(3.0)
    >>> cr.project_({"w": w})                    # ||w - w*|| = 6: scaled back onto the sphere of radius 1
    0.16666666666666666
    >>> round(float(cr.distance({"w": w})), 6)
    1.0
    >>> float(cr.loss(torch.tensor(1.0), torch.tensor(2.0)))
    2.0
"""
from __future__ import annotations

import torch

from featlearn.checkpoints import class_path, read_checkpoint
from featlearn.errors import ConfigError

__all__ = ["ContrastiveRegularization", "trust_region_", "start_from_checkpoint"]


@torch.no_grad()
def start_from_checkpoint(module: torch.nn.Module, field: str, path: str, names: tuple[str, ...]) -> None:
    """Copy the tensors ``names`` of a checkpoint of ``module``'s own class at ``path`` into ``module`` (the first
    one required, the others where the checkpoint has them): the reference a trust region is anchored at. Another
    class, a missing first tensor or another shape is refused under ``field`` (the config field of ``path``)."""
    ckpt = read_checkpoint(field, path)
    found, state = class_path(ckpt), ckpt["state_dict"]
    if (found is not None and found != f"{type(module).__module__}.{type(module).__qualname__}") or names[0] not in state:
        raise ConfigError(field, f"a checkpoint of {type(module).__name__}", f"{path} ({found})")
    for name in (n for n in names if n in state):
        mine = getattr(module, name)
        if state[name].shape != mine.shape:
            raise ConfigError(field, f"a checkpoint with {name} of shape {tuple(mine.shape)}",
                              f"{path} ({name} {tuple(state[name].shape)})")
        mine.copy_(state[name])


@torch.no_grad()
def trust_region_(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], gamma: float) -> float:
    """Move ``params`` (in place) onto ``{theta : ||theta - reference||_F <= gamma}`` (the joint Frobenius norm
    over every tensor): ``theta <- reference + (theta - reference) min(1, gamma / ||theta - reference||)``, the
    Euclidean projection onto the ball. Returns the scale applied (1: already inside).

    Example:
        >>> p = {"a": torch.tensor([3.0, 4.0])}
        >>> trust_region_(p, {"a": torch.zeros(2)}, 1.0), p["a"].tolist()
        (0.2, [0.6000000238418579, 0.800000011920929])
    """
    if not gamma > 0:
        raise ConfigError("gamma", "> 0", gamma)
    dist2 = sum(float(((params[k].double() - reference[k].double()) ** 2).sum()) for k in params)
    scale = min(1.0, gamma / dist2 ** 0.5) if dist2 > 0 else 1.0
    if scale < 1.0:
        for k, p in params.items():
            p.copy_(reference[k] + (p - reference[k]) * scale)
    return scale


class ContrastiveRegularization(torch.nn.Module):
    """``loss = supervised + lam * contrastive`` and the trust region ``||theta - theta*||_F <= gamma``.

    Args:
        lam: weight of the contrastive term (the dissertation: 0.1 for MoCo v2 on CIFAR-10, 1.0 for CLIP and
            SimCSE); ``0`` keeps the supervised loss only.
        gamma: trust-region radius (``None``: no trust region).
    """

    def __init__(self, lam: float = 1.0, gamma: float | None = None):
        super().__init__()
        if not lam >= 0:
            raise ConfigError("lam", ">= 0", lam)
        if gamma is not None and not gamma > 0:
            raise ConfigError("gamma", "> 0 or None", gamma)
        self.lam, self.gamma = float(lam), gamma
        self.names: list[str] = []

    def anchor(self, params: dict[str, torch.Tensor]) -> "ContrastiveRegularization":
        """Take the current values of ``params`` as the reference ``theta*`` (buffers ``ref_<name>``). Returns self."""
        self.names = list(params)
        for name, p in params.items():
            self.register_buffer(f"ref_{name}", p.detach().clone())
        return self

    def reference(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"ref_{name}") for name in self.names}

    def loss(self, supervised: torch.Tensor | float, contrastive: torch.Tensor) -> torch.Tensor:
        """``supervised + lam * contrastive``."""
        return supervised + self.lam * contrastive

    def distance(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """``||theta - theta*||_F`` over the anchored parameters."""
        ref = self.reference()
        return torch.sqrt(sum(((params[k].detach().double() - ref[k].double()) ** 2).sum() for k in self.names))

    @torch.no_grad()
    def project_(self, params: dict[str, torch.Tensor]) -> float:
        """Project ``params`` onto the trust region (in place; a no-op without ``gamma``); returns the scale."""
        if self.gamma is None:
            return 1.0
        if not self.names:
            raise RuntimeError("ContrastiveRegularization.project_: call anchor(params) first")
        return trust_region_({k: params[k] for k in self.names}, self.reference(), self.gamma)
