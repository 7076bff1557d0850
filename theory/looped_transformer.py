"""A looped linear transformer is multi-step gradient descent (Shi's dissertation, Ch. 8; Defs 8.6-8.7, Lemma 8.13,
Theorems 8.14 and 8.25): the chapter's hand-built weights, as an exact float64 oracle.

The prompt stacks n examples ``(x_i, y_i)`` over a query row ``(q, alpha)``:
``Z = [[X, y], [q^T, alpha]]`` (``(n+1) x (d+1)``). One loop applies masked linear attention,
``Z <- Z - eta (M o (Z Q Z^T)) Z P``, where the mask ``M`` lets only the query row attend, and only to the n
examples; weights are shared across loops and the output is ``-q`` after T loops. With ``Q = I`` and
``P = diag(I_d, 0)`` a loop is ``q <- q - eta (X^T X q + alpha X^T y)``, so the output is ``alpha theta_T`` for
``theta_T`` T steps of gradient descent on ``||y - X theta||^2 / 2`` from ``theta_0 = -q_0 / alpha``
(Theorem 8.14); with ``eta = 1 / lambda_max(X^T X)`` its error contracts as ``exp(-t / kappa)``,
``kappa = lambda_max / lambda_min`` of ``X^T X`` (Theorem 8.25).

Example:
    >>> gen = torch.Generator().manual_seed(0)
    >>> X = torch.randn(1, 16, 4, generator=gen, dtype=torch.float64)
    >>> theta = torch.nn.functional.normalize(torch.randn(1, 4, generator=gen, dtype=torch.float64), dim=1)
    >>> y, alpha, eta = (X @ theta.unsqueeze(-1)).squeeze(-1), torch.tensor([0.7], dtype=torch.float64), step_size(X)
    >>> out = looped_attention(prompt_matrix(X, y, alpha), *gd_construction(4), eta, 25)
    >>> gd = gradient_descent(X, y, eta, 25)[-1]
    >>> bool(torch.allclose(-out[:, -1, :4], alpha[:, None] * gd, rtol=1e-12, atol=1e-14))
    True
"""
from __future__ import annotations

import torch


def prompt_matrix(X: torch.Tensor, y: torch.Tensor, alpha: torch.Tensor, q: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``Z = [[X, y], [q^T, alpha]]`` ``[B, n+1, d+1]`` of examples ``X`` ``[B, n, d]``, ``y`` ``[B, n]``, query
    values ``alpha`` ``[B]`` and start ``q`` ``[B, d]`` (default 0)."""
    B, n, d = X.shape
    Z = X.new_zeros(B, n + 1, d + 1)
    Z[:, :n, :d], Z[:, :n, d], Z[:, n, d] = X, y, alpha
    if q is not None:
        Z[:, n, :d] = q
    return Z


def gd_construction(d: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Theorem 8.14's weights ``Q = I_{d+1}``, ``P = diag(I_d, 0)`` (``(d+1) x (d+1)``: the chapter's Def. 8.6
    writes ``d x d``, which cannot multiply a prompt row)."""
    P = torch.eye(d + 1, dtype=dtype)
    P[d, d] = 0.0
    return torch.eye(d + 1, dtype=dtype), P


def looped_attention(Z: torch.Tensor, Q: torch.Tensor, P: torch.Tensor, eta: torch.Tensor, loops: int
                     ) -> torch.Tensor:
    """``loops`` loops of ``Z <- Z - eta (M o (Z Q Z^T)) Z P`` (Defs 8.6-8.7) on prompts ``Z`` ``[B, n+1, d+1]``
    with per-prompt step sizes ``eta`` ``[B]``, written as the definition reads: the full ``(n+1) x (n+1)``
    score matrix, then the mask (query row, example columns)."""
    n = Z.shape[1] - 1
    mask = torch.zeros(n + 1, n + 1, dtype=Z.dtype, device=Z.device)
    mask[n, :n] = 1.0
    for _ in range(loops):
        Z = Z - eta[:, None, None] * ((mask * (Z @ Q @ Z.transpose(1, 2))) @ Z @ P)
    return Z


def step_size(X: torch.Tensor) -> torch.Tensor:
    """``eta = 1 / lambda_max(X^T X)`` per prompt ``[B]`` (the chapter's ``1 / L``)."""
    return 1.0 / torch.linalg.eigvalsh(X.transpose(1, 2) @ X)[:, -1]


def condition_number(X: torch.Tensor) -> torch.Tensor:
    """``kappa = lambda_max / lambda_min`` of ``X^T X`` per prompt ``[B]`` (Theorem 8.25's rate ``exp(-t/kappa)``).

    Example:
        >>> condition_number(torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64)).unsqueeze(0)).tolist()
        [4.0]
    """
    eig = torch.linalg.eigvalsh(X.transpose(1, 2) @ X)
    return eig[:, -1] / eig[:, 0]


def gradient_descent(X: torch.Tensor, y: torch.Tensor, eta: torch.Tensor, steps: int,
                     theta0: torch.Tensor | None = None) -> torch.Tensor:
    """Iterates ``theta_0 .. theta_steps`` ``[steps + 1, B, d]`` of ``theta <- theta - eta X^T (X theta - y)``
    (default ``theta_0 = 0``)."""
    theta = X.new_zeros(X.shape[0], X.shape[2]) if theta0 is None else theta0
    out = [theta]
    for _ in range(steps):
        residual = (X @ theta.unsqueeze(-1)).squeeze(-1) - y
        theta = theta - eta[:, None] * (X.transpose(1, 2) @ residual.unsqueeze(-1)).squeeze(-1)
        out.append(theta)
    return torch.stack(out)
