"""The spectrum of a representation: how many directions a batch of features uses, and the nuclear norm as a
loss term any method can add (Shi 2024, Ch. 6 = Shi, Ming, Fan, Sala, Liang, "Domain Generalization via Nuclear
Norm Regularization", CPAL 2024, arXiv:2303.07527: ERM plus ``lambda`` times the nuclear norm of the batch's
features).

A representation that collapses (to one direction, or to a few) shows it first in its spectrum: the stable rank
``||F||_F^2 / ||F||_2^2`` and the effective rank ``exp(H(s / sum s))`` (Roy and Vetterli 2007; ``s`` the singular
values) of the centred feature matrix ``F`` ``[n, m]`` fall towards 1.

Example:
    >>> F = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    >>> round(stable_rank(F), 4), round(effective_rank(F), 4), round(float(nuclear_norm(F)), 4)
    (1.25, 1.8899, 4.2426)
"""
from __future__ import annotations

import torch

__all__ = ["centred_singular_values", "stable_rank", "effective_rank", "nuclear_norm"]


def centred_singular_values(F: torch.Tensor) -> torch.Tensor:
    """Singular values of ``F - mean(F)`` ``[n, m]`` in float64, largest first."""
    F = F.detach().double()
    return torch.linalg.svdvals(F - F.mean(0, keepdim=True))


def stable_rank(F: torch.Tensor) -> float:
    """``||F||_F^2 / ||F||_2^2`` of the centred features (1 for one direction, m for an isotropic cloud)."""
    s = centred_singular_values(F)
    return float(s.square().sum() / s[0].square()) if len(s) and s[0] > 0 else 0.0


def effective_rank(F: torch.Tensor) -> float:
    """``exp`` of the entropy of the normalised singular values of the centred features."""
    s = centred_singular_values(F)
    if not len(s) or s.sum() <= 0:
        return 0.0
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


class _NuclearNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, F):
        U, s, Vh = torch.linalg.svd(F, full_matrices=False)
        ctx.save_for_backward(U, s, Vh)
        return s.sum()

    @staticmethod
    def backward(ctx, grad):
        U, s, Vh = ctx.saved_tensors
        keep = _above_tolerance(s, U.shape[-2], Vh.shape[-1])
        return grad * ((U * keep.unsqueeze(-2)) @ Vh)  # U_r V_r^T


def _above_tolerance(s: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The singular values above ``s_max max(m, n) eps`` (``torch.linalg.matrix_rank``'s rule): the others are zero
    to rounding, and their singular vectors are whatever the solver picked."""
    if not s.numel():
        return torch.ones_like(s, dtype=torch.bool)
    return s > s.amax(-1, keepdim=True) * max(m, n) * torch.finfo(s.dtype).eps


def nuclear_norm(F: torch.Tensor) -> torch.Tensor:
    """``||F||_* = sum of the singular values`` of the features ``F`` ``[n, m]`` (not centred: the chapter's
    penalty), differentiable. Its gradient is ``U_r V_r^T`` from one thin SVD, over the r singular values above
    a relative tolerance (``torch.linalg.matrix_rank``'s): at full rank the gradient (``svdvals``' autograd
    computes the same), and where F is rank-deficient the minimum-norm subgradient (0 at F = 0), not the
    arbitrary singular vectors of its zero singular values. Add ``lam * nuclear_norm(features)`` to a loss for
    ERM-NU."""
    return _NuclearNorm.apply(F)
