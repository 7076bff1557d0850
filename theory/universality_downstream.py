"""Downstream use of a representation of the linear multi-task model (Shi 2024, Ch. 7 and App. F; Shi et al.
2023): how well a few labels of one task are fitted on it, and how alike two representations are. The model and
the closed forms of its representations are :mod:`featlearn.theory.universality`; everything here is a plain
function of tensors.

* :func:`ridge_fit`, :func:`ridge_loo_errors`, :func:`downstream_errors`: the downstream linear probe, ridge
  regression WITHOUT feature standardisation (standardising would undo the very scaling the trade-off is
  about) and with ``lambda`` chosen per representation by exact leave-one-out on the labelled set from one
  fixed grid (the same tuning budget for every representation).
* :func:`predictor_bound`, :func:`norm_constrained_fit`: the paper's own predictor class ``{||u|| <= B_{phi,t}}``
  (Eq. 7.2 with the squared loss), the other probe of ``downstream_errors``.
* :func:`linear_cka`: linear CKA between two representations of the same inputs.

Example:
    >>> F = torch.eye(2, dtype=torch.float64)
    >>> ridge_fit(F, torch.ones(2, dtype=torch.float64), 0.0).tolist(), predictor_bound(torch.ones(2), 1, 1.0, 1.0)
    ([1.0, 1.0], 1.4142135623730951)
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from featlearn.errors import ConfigError

__all__ = ["LAMBDA_GRID", "ridge_fit", "ridge_loo_errors", "predictor_bound", "norm_constrained_fit",
           "downstream_errors", "linear_cka"]

LAMBDA_GRID = tuple(10.0 ** (e / 2) for e in range(-8, 7))
"""Ridge penalties tried for every representation (1e-4 ... 1e3, half decades); chosen by leave-one-out."""


# ------------------------------------------------------------------------------------------------
# downstream: ridge with lambda by leave-one-out
# ------------------------------------------------------------------------------------------------
def ridge_fit(F: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """``argmin_u ||F u - y||^2 / m + lam ||u||^2`` (no intercept: features and labels are centred by
    construction; no standardisation), float64.

    Example:
        >>> F = torch.eye(3, dtype=torch.float64); ridge_fit(F, torch.ones(3, dtype=torch.float64), 0.0).tolist()
        [1.0, 1.0, 1.0]
    """
    F, y = F.double(), y.double()
    m, k = F.shape
    if m >= k:
        return torch.linalg.solve(F.t() @ F + lam * m * torch.eye(k, dtype=F.dtype, device=F.device), F.t() @ y)
    return F.t() @ torch.linalg.solve(F @ F.t() + lam * m * torch.eye(m, dtype=F.dtype, device=F.device), y)


def ridge_loo_errors(F: torch.Tensor, y: torch.Tensor, lambdas: Sequence[float] = LAMBDA_GRID) -> torch.Tensor:
    """Exact leave-one-out squared errors of :func:`ridge_fit` for each ``lambda`` (``[len(lambdas)]``):
    ``mean_i (e_i / (1 - H_ii))^2`` with the hat matrix ``H = F (F^T F + lam m I)^-1 F^T``.

    Example:
        >>> F = torch.randn(20, 3, dtype=torch.float64); y = F @ torch.ones(3, dtype=torch.float64)
        >>> bool(ridge_loo_errors(F, y, [1e-8])[0] < 1e-12)
        True
    """
    F, y = F.double(), y.double()
    m = F.shape[0]
    K = F @ F.t()
    evals, evecs = torch.linalg.eigh(K)
    evals = evals.clamp_min(0)
    proj = evecs.t() @ y
    out = []
    for lam in lambdas:
        shrink = evals / (evals + lam * m)  # H = V diag(shrink) V^T (the m x m form works for any k)
        fitted = evecs @ (shrink * proj)
        h = (evecs ** 2) @ shrink
        out.append(float((((y - fitted) / (1 - h).clamp_min(1e-12)) ** 2).mean()))
    return torch.tensor(out, dtype=torch.float64)


def predictor_bound(label_vector: torch.Tensor, s: int, c_S: float, c_P: float) -> float:
    """``B_{phi,t}`` of the paper's predictor class ``{||u|| <= B}``: the norm of the least-norm predictor that is
    best for task ``t`` on a representation with column norms ``c_S`` on ``S`` and ``c_P`` on ``P_t``
    (``u_j = u*_j / sqrt(c_j)`` on the encoded features; a group with ``c = 0`` is not encoded and takes no norm).
    ``label_vector`` is ``u_t*`` on ``(S, P_t)`` (``[r]``).

    Example:
        >>> u = torch.full((4,), 0.5, dtype=torch.float64)                  # v1 = v2 = 1/2, s = 2
        >>> round(predictor_bound(u, 2, 1.0, 0.125), 4), predictor_bound(u, 2, 1.0, 1.0), round(predictor_bound(u, 2, 1.0, 0.0), 4)
        (2.1213, 1.0, 0.7071)
    """
    u = label_vector.double()
    total = float((u[:s] ** 2).sum()) / c_S if c_S > 0 else 0.0
    total += float((u[s:] ** 2).sum()) / c_P if c_P > 0 else 0.0
    return math.sqrt(total)


def norm_constrained_fit(F: torch.Tensor, y: torch.Tensor, bound: float) -> torch.Tensor:
    """``argmin_{||u|| <= bound} ||F u - y||^2`` (the paper's downstream ERM, Eq. 7.2 with the squared loss), float64.

    The least-norm least-squares solution if it is inside the ball; otherwise the ridge solution whose norm is
    exactly ``bound`` (``||u(lambda)||`` decreases in ``lambda``: bisection on the singular values of one SVD).

    Example:
        >>> F = torch.eye(2, dtype=torch.float64); y = torch.tensor([3.0, 4.0], dtype=torch.float64)
        >>> norm_constrained_fit(F, y, 10.0).tolist(), norm_constrained_fit(F, y, 1.0).tolist()
        ([3.0, 4.0], [0.6, 0.8])
    """
    if not bound > 0:
        raise ConfigError("bound", "> 0", bound)
    F, y = F.double(), y.double()
    U, sig, Vh = torch.linalg.svd(F, full_matrices=False)
    keep = sig > sig.max() * 1e-12 if sig.numel() else sig > 0
    U, sig, Vh = U[:, keep], sig[keep], Vh[keep]
    proj = U.t() @ y
    # the bisection on host floats (a torch call per probe cost ~5 ms a fit, most of the m-sweep's time)
    s_np, p_np = sig.detach().cpu().numpy(), proj.detach().cpu().numpy()
    norm = lambda lam: float(np.linalg.norm(s_np * p_np / (s_np ** 2 + lam)))  # noqa: E731
    lam = 0.0
    if norm(0.0) > bound:
        lo, hi = 0.0, float(np.linalg.norm(s_np * p_np)) / bound  # at hi: ||u|| <= ||S p|| / hi = bound
        for _ in range(200):
            mid = (lo + hi) / 2
            if mid in (lo, hi):  # converged to adjacent floats: later probes change nothing
                break
            lo, hi = (mid, hi) if norm(mid) > bound else (lo, mid)
        lam = hi
    return Vh.t() @ (sig * proj / (sig ** 2 + lam))


def downstream_errors(F_train: torch.Tensor, y_train: torch.Tensor, F_test: torch.Tensor, y_test: torch.Tensor,
                      ms: Sequence[int], repeats: int, lambdas: Sequence[float] = LAMBDA_GRID,
                      sign: bool = False, bound: float | None = None) -> dict[int, dict[str, float]]:
    """Test error of ridge (or, with ``bound``, of :func:`norm_constrained_fit`) on the representation against
    the number of labels ``m``.

    ``F_train [repeats * max(ms), k]`` holds ``repeats`` disjoint labelled sets of ``max(ms)`` samples; for
    each ``m`` the first ``m`` of each set are used (nested label sets), ``lambda`` is chosen on them by
    leave-one-out from ``lambdas`` (no ``lambda`` with ``bound``: the ball is the only regulariser), and the test MSE on ``(F_test, y_test)`` is averaged over the sets. With
    ``sign`` labels the accuracy of ``sign(prediction)`` is reported too.

    Returns ``{m: {"mse": ..., "mse_min": ..., "mse_max": ..., "lambda_median": ..., ["acc": ...]}}``.

    Example:
        >>> F = torch.randn(2 * 30, 2, dtype=torch.float64); y = F[:, 0]
        >>> out = downstream_errors(F, y, F[:10], y[:10], ms=[10, 30], repeats=2)
        >>> out[30]["mse"] < 1e-3
        True
    """
    n = max(ms)
    if F_train.shape[0] < repeats * n:
        raise ConfigError("F_train", f"at least repeats * max(ms) = {repeats * n} rows", F_train.shape[0])
    F_test, y_test = F_test.double(), y_test.double()
    out = {}
    for m in ms:
        mses, accs, lams = [], [], []
        for j in range(repeats):
            F, y = F_train[j * n: j * n + m].double(), y_train[j * n: j * n + m].double()
            if bound is None:
                lam = lambdas[int(torch.argmin(ridge_loo_errors(F, y, lambdas)))] if m > 1 else lambdas[-1]
                pred = F_test @ ridge_fit(F, y, lam)
            else:
                lam = float("nan")
                pred = F_test @ norm_constrained_fit(F, y, bound)
            mses.append(float(((pred - y_test) ** 2).mean()))
            accs.append(float((torch.sign(pred) == torch.sign(y_test)).double().mean()))
            lams.append(lam)
        row = {"mse": sum(mses) / repeats, "mse_min": min(mses), "mse_max": max(mses),
               "lambda_median": sorted(lams)[repeats // 2]}
        if sign:
            row["acc"] = sum(accs) / repeats
        out[int(m)] = row
    return out


def linear_cka(X: torch.Tensor, Y: torch.Tensor) -> float:
    """Linear CKA ``||Y_c^T X_c||_F^2 / (||X_c^T X_c||_F ||Y_c^T Y_c||_F)`` of two representations ``[n, *]`` of
    the same inputs (columns centred; float64). 1 for representations equal up to rotation and scale.

    Example:
        >>> X = torch.randn(50, 3, dtype=torch.float64)
        >>> round(linear_cka(X, 2 * X @ torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64))[0]), 6)
        1.0
    """
    x = X.double() - X.double().mean(0)
    y = Y.double() - Y.double().mean(0)
    num = torch.linalg.matrix_norm(y.t() @ x) ** 2
    den = torch.linalg.matrix_norm(x.t() @ x) * torch.linalg.matrix_norm(y.t() @ y)
    return float(num / den.clamp_min(1e-300))
