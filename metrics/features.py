"""Representation-geometry metrics shared by every method.

Example:
    >>> a = torch.tensor([[1.0, 0.0], [0.0, 0.0]]); b = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    >>> mean_cosine(a, b).item()   # the zero row is skipped
    1.0
"""
from __future__ import annotations

import torch

__all__ = ["mean_cosine"]


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean cosine of the paired rows of ``a`` and ``b`` ``[n, m]``, over pairs where both are nonzero
    (0 when there are none)."""
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    keep = (na > 0) & (nb > 0)
    if not keep.any():
        return torch.zeros((), dtype=a.dtype, device=a.device)
    return ((a * b).sum(-1)[keep] / (na[keep] * nb[keep])).mean()
