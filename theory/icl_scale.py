"""Why larger models do in-context learning differently (Shi 2024, Ch. 5): the closed forms of linear-regression
in-context learning by a linear self-attention whose key-query matrix has rank r (Section 5.4), and the constructed
optima of sparse-parity in-context learning by multi-head attention (Section 5.5, :func:`parity_heads`).

Prompts hold N examples ``x_i ~ N(0, Lambda)`` with labels ``y_i = <w, x_i>`` (task ``w ~ N(0, I_d)``) and a query
``x_q``; ``Lambda = Q D Q^T`` with eigenvalues ``lambda_1 >= ... >= lambda_d``. The attention predicts
``y_hat = (u / rho) sum_i y_i x_i^T U x_q`` (the prompt's last entry after one layer, Eq. 5.1); only ``Gamma = u U``
matters, and the model's scale is ``r = rank(U)``. With ``rho = N`` the population loss
``E (y_hat - y_q)^2`` is, for ``Gamma = Q diag(g) Q^T``, ``sum_i (N+1)/N lambda_i^3 g_i^2 + tr(D) lambda_i^2 g_i^2 / N
- 2 lambda_i^2 g_i + lambda_i`` (:func:`population_loss` has the general form), so the best rank-r model keeps the top r
eigen-directions with ``g_i = v_i* = N / ((N + 1) lambda_i + tr D)`` (Theorem 5.4.1). On an evaluation prompt of M
examples with label noise ``sigma^2`` and a task ``w = Q (s + xi)`` (``s`` on the top r coordinates, ``xi`` on the
rest) its loss is Theorem 5.4.2's :func:`evaluation_loss`, and a larger rank r' > r pays
:func:`rank_gap` more on tasks inside the top r directions (Theorem 5.4.3): the larger model attends to more
directions, so more of the label noise reaches its prediction.

Example:
    >>> lam = torch.tensor([4.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    >>> tuple(round(v, 4) for v in optimal_scales(lam, N=20, r=2).tolist())
    (0.2186, 0.404, 0.0, 0.0)
    >>> s = torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64)
    >>> round(rank_gap(lam, s, sigma=0.5, N=20, M=20, r=2, r_larger=4), 6) > 0
    True
"""
from __future__ import annotations

import torch

from featlearn.errors import ConfigError


def _check(lambdas: torch.Tensor, r: int | None = None, sigma: float | None = None) -> None:
    if lambdas.dim() != 1 or not bool((lambdas > 0).all()) or not bool((lambdas[:-1] >= lambdas[1:]).all()):
        raise ConfigError("lambdas", "positive eigenvalues in non-increasing order", lambdas.tolist())
    if r is not None and not 0 <= r <= len(lambdas):
        raise ConfigError("r", f"a rank in [0, d] = [0, {len(lambdas)}]", r)
    if sigma is not None and not sigma >= 0:
        raise ConfigError("sigma", "a noise standard deviation >= 0", sigma)


def optimal_scales(lambdas: torch.Tensor, N: int, r: int) -> torch.Tensor:
    """Theorem 5.4.1's ``v*``: ``N / ((N + 1) lambda_i + tr D)`` on the top ``r`` eigen-directions, 0 elsewhere."""
    _check(lambdas, r)
    v = N / ((N + 1) * lambdas + lambdas.sum())
    v[r:] = 0.0
    return v


def optimal_attention(Q: torch.Tensor, lambdas: torch.Tensor, N: int, r: int, c: float = 1.0
                      ) -> tuple[torch.Tensor, float]:
    """``(U*, u*) = (c Q diag(v*) Q^T, 1 / c)``: the rank-r optimum of Theorem 5.4.1 (any ``c != 0``)."""
    if c == 0:
        raise ConfigError("c", "a non-zero scale", c)
    return c * Q @ torch.diag(optimal_scales(lambdas, N, r)).to(Q) @ Q.T, 1.0 / c


def population_loss(Gamma: torch.Tensor, Lambda: torch.Tensor, N: int) -> torch.Tensor:
    """``E (y_hat - y_q)^2`` of ``y_hat = x_q^T Gamma^T S w`` with ``S = sum_i x_i x_i^T / N`` (``rho = N``), exactly:
    ``(N+1)/N tr(Lambda Gamma^T Lambda Gamma Lambda)`` (the Gaussian fourth moment) ``+ tr(Gamma^T Lambda Gamma
    Lambda) tr(Lambda) / N - 2 tr(Lambda Gamma^T Lambda) + tr(Lambda)``; differentiable in ``Gamma``."""
    A = Gamma @ Lambda @ Gamma.T
    return ((N + 1) / N * torch.trace(Lambda @ A @ Lambda) + torch.trace(A @ Lambda) * torch.trace(Lambda) / N
            - 2 * torch.trace(Lambda @ Gamma.T @ Lambda) + torch.trace(Lambda))


def expected_loss(Gamma: torch.Tensor, Lambda: torch.Tensor, M: int, sigma: float = 0.0,
                  w: torch.Tensor | None = None) -> torch.Tensor:
    """The exact ``E (y_hat - y_q)^2`` of any ``Gamma`` on prompts of ``M`` examples ``x_i ~ N(0, Lambda)`` whose
    labels carry noise ``sigma^2`` (``rho = M``, noise-free query), for the task ``w`` (``None``: averaged over ``w
    ~ N(0, I_d)``). With ``h = sum_i y_i x_i / M``, ``E h h^T = (1 + 1/M) Lambda w w^T Lambda + (||w||^2_Lambda +
    sigma^2) Lambda / M`` (the Gaussian fourth moment), and the loss is ``tr(Lambda Gamma^T E[h h^T] Gamma) - 2
    w^T Lambda Gamma^T Lambda w + ||w||^2_Lambda``. At ``sigma = 0``, ``M = N`` and ``w`` averaged it is
    :func:`population_loss`; for ``Gamma = Q diag(v) Q^T`` and ``w = Q (s + xi)``, Theorem 5.4.2's
    :func:`evaluation_loss`. Differentiable in ``Gamma``."""
    if not bool((torch.linalg.eigvalsh(Lambda) > 0).all()):
        raise ConfigError("Lambda", "a positive definite covariance", "eigenvalues " + str(torch.linalg.eigvalsh(Lambda).tolist()))
    if not M >= 1:
        raise ConfigError("M", "at least 1 example per prompt", M)
    if not sigma >= 0:
        raise ConfigError("sigma", "a noise standard deviation >= 0", sigma)
    if w is None:
        outer, energy = Lambda @ Lambda, torch.trace(Lambda)  # E w w^T = I
    else:
        Lw = Lambda @ w
        outer, energy = torch.outer(Lw, Lw), w @ Lw
    second = (1 + 1 / M) * outer + (energy + sigma ** 2) * Lambda / M
    cross = torch.trace(Lambda @ Gamma.T @ Lambda) if w is None else Lw @ Gamma.T @ Lw
    return torch.trace(Lambda @ Gamma.T @ second @ Gamma) - 2 * cross + energy


def evaluation_loss(lambdas: torch.Tensor, v: torch.Tensor, s: torch.Tensor, xi: torch.Tensor, sigma: float,
                    M: int) -> float:
    """Theorem 5.4.2: the loss of ``Gamma = Q diag(v) Q^T`` (``v`` zero past its rank r) on prompts of ``M`` examples
    with label noise ``sigma^2`` and task ``w = Q (s + xi)`` (eigen-coordinates; ``s`` zero past r, ``xi`` zero up
    to r), ``rho = M`` and a noise-free query::

        ||s||^2_{V^2 D^3} / M + (||s + xi||^2_D + sigma^2) tr(V^2 D^2) / M + ||xi||^2_D + sum_i s_i^2 lambda_i (lambda_i v_i - 1)^2
    """
    _check(lambdas, sigma=sigma)
    a = s + xi
    return float((s ** 2 * v ** 2 * lambdas ** 3).sum() / M
                 + ((a ** 2 * lambdas).sum() + sigma ** 2) * (v ** 2 * lambdas ** 2).sum() / M
                 + (xi ** 2 * lambdas).sum() + (s ** 2 * lambdas * (lambdas * v - 1) ** 2).sum())


def rank_gap(lambdas: torch.Tensor, s: torch.Tensor, sigma: float, N: int, M: int, r: int, r_larger: int) -> float:
    """Theorem 5.4.3: how much more the rank-``r_larger`` optimum loses than the rank-``r`` one on a task ``w = Q s``
    inside the top ``r`` directions: ``(||s||^2_D + sigma^2) / M sum_{i=r+1}^{r'} (N lambda_i / ((N+1) lambda_i
    + tr D))^2`` (> 0: the larger model is the more sensitive to label noise)."""
    _check(lambdas, r_larger, sigma)
    if not 0 <= r < r_larger:
        raise ConfigError("r", f"a rank in [0, r_larger) = [0, {r_larger})", r)
    extra = (N * lambdas / ((N + 1) * lambdas + lambdas.sum()))[r:r_larger]
    return float(((s ** 2 * lambdas).sum() + sigma ** 2) / M * (extra ** 2).sum())


def lsa_prediction(X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor, U: torch.Tensor, u: float,
                   rho: float) -> torch.Tensor:
    """``(u / rho) sum_i y_i x_i^T U x_q`` per prompt: ``X`` ``[B, N, d]``, ``y`` ``[B, N]``, ``x_q`` ``[B, d]``."""
    return u / rho * torch.einsum("bn,bnd,de,be->b", y, X, U, x_q)


def parity_heads(nu: int, gamma: float, d: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Theorem 5.5.1's heads on ``d`` features (default ``2^nu``), in the basis ``G`` (``W_i = G diag(V_i) G^T``):
    ``(a [2(nu+1)], V [2(nu+1), d])``. Head ``h < nu``: ``a = -1``, ``V_t = (2 bit_h(t) - 1) / (4 gamma)`` (``bit_h(t)``: bit h of
    the 0-based feature index t); head ``nu``: ``a = +1``, ``V = -nu / (4 gamma)``; heads ``nu+1 ..`` mirror the first
    ``nu + 1`` (``-V``, the same ``a``). The small model is ``nu = nu1`` (the ``k = 2^nu1`` important features), the
    large one ``nu = nu2`` (all ``d = 2^nu2``); the theorem's small model is read on all ``d = 2^nu2`` features
    (its neurons are the large model's, with the constant head's ``-nu1 / (4 gamma)``)."""
    if not nu >= 1:
        raise ConfigError("nu", "an integer >= 1 (2^nu features)", nu)
    if not 0 < gamma < 0.25:
        raise ConfigError("gamma", "in (0, 1/4)", gamma)
    d = 2 ** nu if d is None else d
    if not d >= 2 ** nu:
        raise ConfigError("d", f"at least 2^nu = {2 ** nu} features", d)
    t = torch.arange(d)
    bits = torch.stack([(t >> h) & 1 for h in range(nu)]).double()
    V = torch.cat([(2 * bits - 1) / (4 * gamma), torch.full((1, d), -nu / (4 * gamma), dtype=torch.float64)])
    a = torch.cat([-torch.ones(nu, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    return torch.cat([a, a]), torch.cat([V, -V])


def parity_output(a: torch.Tensor, V: torch.Tensor, i: int, j: int, phi_i: torch.Tensor, phi_j: torch.Tensor,
                  gamma: float) -> torch.Tensor:
    """The population output ``sum_h a_h ReLU((y^T X / N) W_h x_q)`` (N -> infinity) on task ``(i, j)`` for queries
    with ``phi_q,i = phi_i``, ``phi_q,j = phi_j``: the in-context mean ``y^T X / N`` tends to ``2 gamma G (e_i +
    e_j)`` (``E[y phi_i] = E[phi_j] = 2 gamma`` under the task's skewed pair distribution, 0 elsewhere), so head h
    reads ``2 gamma (V_h,i phi_i + V_h,j phi_j)``."""
    reads = 2 * gamma * (V[:, i:i + 1] * phi_i + V[:, j:j + 1] * phi_j)  # [heads, queries]
    return (a[:, None] * torch.relu(reads)).sum(0)
