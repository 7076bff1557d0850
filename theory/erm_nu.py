"""ERM-NU and its theory model (Shi 2024, Ch. 6 = Zhenmei Shi, Yifei Ming, Ying Fan, Frederic Sala, Yingyu Liang,
"Domain Generalization via Nuclear Norm Regularization", CPAL 2024, arXiv:2303.07527): closed forms and predictions.

The theory model (Sec. 6.4): ``z = x y`` in ``R^d``; the r coordinates of R are ``U[0,1]``, the d - r of U follow
``D_gamma`` (mean gamma) in distribution and ``D_-gamma`` out of it. A linear model ``f_w(x) = sum_j w_j x_j`` is
right on a sample when its margin ``m = sum_j w_j z_j`` is positive.

* Lemma 6.1: the ERM-l2 optimum is ``alpha`` on every coordinate of R and ``beta`` on every coordinate of U, with
  ``0 < beta < alpha < 1 / sqrt(r)`` and ``alpha / beta < 3 / (4 gamma)``. :func:`l2_optimum` computes it.
* Lemma 6.2: the ERM-rank optimum (``||w||_0 <= B_rank``) puts all its weight on R.
* Prop. 6.3 (under :func:`prop63_conditions`, lambda above :func:`prop63_lambda_threshold` up to a constant):
  ERM-rank is right on every OOD sample (a positive combination of ``U[0,1]`` coordinates is positive); ERM-l2 is
  right on at most ``exp(-r/10)`` of them (:func:`l2_ood_bound`).

Margins are sums of many independent bounded terms: :func:`accuracy_normal` reads an accuracy off their mean and
variance (:func:`margin_moments`), and :func:`l2_optimum` minimises the population loss under the same normal
approximation (Gauss-Hermite quadrature). For the 2-D toy (Sec. 6.3.1), :func:`toy_accuracy` is exact.

Example:
    >>> alpha, beta = l2_optimum(r=64, d=512, gamma=0.45, lam=0.1)
    >>> round(alpha, 4), round(beta, 4), alpha / beta < lemma61_ratio_bound(0.45)
    (0.0249, 0.0224, True)
    >>> w = torch.cat([torch.full((64,), alpha), torch.full((448,), beta)])
    >>> accuracy_normal(w, r=64, gamma=0.45) > 0.999, accuracy_normal(w, r=64, gamma=-0.45) < l2_ood_bound(64)
    (True, True)
"""
from __future__ import annotations

import math

import numpy as np
import torch

from featlearn.errors import ConfigError

_NODES, _WEIGHTS = (torch.from_numpy(a) for a in np.polynomial.hermite.hermgauss(80))


def l2_ood_bound(r: int) -> float:
    """Prop. 6.3's ceiling on the OOD accuracy of ERM-l2, ``exp(-r / 10)``.

    Example:
        >>> round(l2_ood_bound(64), 5)
        0.00166
    """
    return math.exp(-r / 10)


def lemma61_ratio_bound(gamma: float) -> float:
    """Lemma 6.1's bound on the ERM-l2 optimum's ``alpha / beta``: ``3 / (4 gamma)``."""
    if not 0 < gamma < 0.5:
        raise ConfigError("gamma", "in (0, 1/2)", gamma)
    return 3 / (4 * gamma)


def prop63_lambda_threshold(r: int) -> float:
    """Prop. 6.3's lower bound on lambda, ``Omega(sqrt(r) / exp(sqrt(r) / 5))``, with the hidden constant taken as 1.

    Example:
        >>> round(prop63_lambda_threshold(64), 2), round(prop63_lambda_threshold(100), 2)
        (1.62, 1.35)
    """
    return math.sqrt(r) / math.exp(math.sqrt(r) / 5)


def prop63_conditions(r: int, d: int, gamma: float, b_rank: int | None = None,
                      lam: float | None = None) -> dict[str, bool]:
    """Which of Prop. 6.3's conditions hold: ``gamma_window`` (``3 / sqrt(r) < gamma < 1/2``, non-empty only for r >
    36), ``dimension`` (``d > r / gamma^2 + r``), given ``b_rank``, ``b_rank`` (``1 <= B_rank <= r``) and, given
    ``lam``, ``lambda_constant_1`` (``lam >`` :func:`prop63_lambda_threshold`: the condition's constant is hidden,
    so this reads it as 1). ``r > C`` hides an unknown ``C < 20`` and is not checked.

    Example:
        >>> prop63_conditions(64, 512, 0.45, 8)
        {'gamma_window': True, 'dimension': True, 'b_rank': True}
        >>> prop63_conditions(64, 128, 0.45, lam=0.1)
        {'gamma_window': True, 'dimension': False, 'lambda_constant_1': False}
    """
    out = {"gamma_window": 3 / math.sqrt(r) < gamma < 0.5, "dimension": d > r / gamma ** 2 + r}
    if b_rank is not None:
        out["b_rank"] = 1 <= b_rank <= r
    if lam is not None:
        out["lambda_constant_1"] = lam > prop63_lambda_threshold(r)
    return out


def spurious_variance(gamma: float) -> float:
    """``Var z_j`` under ``D_gamma``: ``E z^2 - gamma^2 = 1/3 - gamma^2`` (either sign of gamma)."""
    return 1 / 3 - gamma ** 2


def margin_moments(w: torch.Tensor, r: int, gamma: float) -> tuple[float, float]:
    """Mean and variance of the margin ``sum_j w_j z_j`` when the first r coordinates are ``U[0,1]`` (mean 1/2,
    variance 1/12) and the others follow ``D_gamma`` (pass ``-gamma`` for the OOD distribution).

    Example:
        >>> tuple(round(v, 4) for v in margin_moments(torch.tensor([1.0, 0.0, 2.0]), r=2, gamma=0.25))
        (1.0, 1.1667)
    """
    w = w.detach().double()
    mean = float(w[:r].sum() / 2 + gamma * w[r:].sum())
    var = float(w[:r].square().sum() / 12 + spurious_variance(gamma) * w[r:].square().sum())
    return mean, var


def accuracy_normal(w: torch.Tensor, r: int, gamma: float) -> float:
    """``P(margin > 0)`` under the normal approximation, ``Phi(mean / sd)`` of :func:`margin_moments` (0.5 for w =
    0). Exact in the limit of many comparable weights; on R alone the margin is positive, so ERM-rank's accuracy
    is 1 in fact while this reads slightly less for few coordinates.

    Example:
        >>> round(accuracy_normal(torch.ones(8), r=4, gamma=-0.3), 4)
        0.758
    """
    mean, var = margin_moments(w, r, gamma)
    if var <= 0:
        return 0.5 if mean == 0 else float(mean > 0)
    return 0.5 * math.erfc(-mean / math.sqrt(2 * var))


def l2_population_loss(alpha: torch.Tensor, beta: torch.Tensor, r: int, d: int, gamma: float,
                       lam: float) -> torch.Tensor:
    """ERM-l2's objective at ``w = (alpha on R, beta on U)``: ``E log(1 + exp(-m)) + lam/2 ||w||^2`` with the margin
    m normal (:func:`margin_moments`), by Gauss-Hermite quadrature; differentiable in alpha and beta."""
    mean = alpha * r / 2 + beta * (d - r) * gamma
    sd = torch.sqrt(alpha ** 2 * r / 12 + beta ** 2 * (d - r) * spurious_variance(gamma))
    m = mean + math.sqrt(2) * sd * _NODES
    risk = (_WEIGHTS * torch.nn.functional.softplus(-m)).sum() / math.sqrt(math.pi)
    return risk + lam / 2 * (r * alpha ** 2 + (d - r) * beta ** 2)


def l2_optimum(r: int, d: int, gamma: float, lam: float) -> tuple[float, float]:
    """Lemma 6.1's ``(alpha, beta)``: the ERM-l2 optimum in distribution, by Newton's method on
    :func:`l2_population_loss` (convex) from the small-weight limit :func:`l2_small_weight_limit`."""
    if lam <= 0:
        raise ConfigError("lam", "> 0 (without l2 the separable loss has no minimiser)", lam)
    def f(t):
        return l2_population_loss(t[0], t[1], r, d, gamma, lam)

    theta = torch.tensor(l2_small_weight_limit(gamma, lam), dtype=torch.float64)
    theta = theta / max(1.0, float(theta[0] * r / 2 + theta[1] * (d - r) * gamma))  # a start with margins ~ 1
    for _ in range(100):
        grad, hess = torch.autograd.functional.jacobian(f, theta), torch.autograd.functional.hessian(f, theta)
        step = torch.linalg.solve(hess, grad)
        while not f(theta - step) <= f(theta) and step.abs().max() > 1e-15:  # damped: never uphill, never NaN
            step = step / 2
        theta = theta - step
        if step.abs().max() < 1e-13:
            break
    return float(theta[0]), float(theta[1])


def l2_small_weight_limit(gamma: float, lam: float) -> tuple[float, float]:
    """The ERM-l2 optimum for large lam, where the loss is linear near ``m = 0`` (``log(1 + e^-m) ~ log 2 - m/2``):
    ``w = E z / (2 lam)``, i.e. ``alpha = 1 / (4 lam)``, ``beta = gamma / (2 lam)``, ``alpha / beta = 1 / (2 gamma)``.

    Example:
        >>> l2_small_weight_limit(0.25, 10.0)
        (0.025, 0.0125)
    """
    return 1 / (4 * lam), gamma / (2 * lam)


def weight_structure(w: torch.Tensor, r: int) -> dict[str, float]:
    """What Lemmas 6.1 and 6.2 say about a weight vector: ``alpha`` and ``beta`` (its means on R and U),
    ``invariant_share`` (``sum_R |w_j| / sum |w_j|``) and ``support_invariant`` (the share of its nonzero
    coordinates that lie in R).

    Example:
        >>> weight_structure(torch.tensor([2.0, 1.0, 0.0, 1.0]), r=2)
        {'alpha': 1.5, 'beta': 0.5, 'invariant_share': 0.75, 'support_invariant': 0.6667}
    """
    w = w.detach().double()
    total, nonzero = float(w.abs().sum()), w != 0
    return {"alpha": float(w[:r].mean()), "beta": float(w[r:].mean()),
            "invariant_share": float(w[:r].abs().sum()) / total if total > 0 else 0.0,
            "support_invariant": round(float(nonzero[:r].sum() / nonzero.sum()), 4) if nonzero.any() else 0.0}


# --- the 2-D toy (Sec. 6.3.1) --------------------------------------------------------------------------
def _positive(a: float, b: float) -> float:
    """``P(a U1 + b U2 > 0)`` for independent ``U1, U2 ~ U[0,1]``."""
    if a >= 0 and b >= 0:
        return float(a > 0 or b > 0)
    if a <= 0 and b <= 0:
        return 0.0
    t = max(a, b) / -min(a, b)  # P(U < t V) for the positive coefficient's U
    return t / 2 if t <= 1 else 1 - 1 / (2 * t)


def toy_accuracy(w1: float, w2: float, p_align: float) -> float:
    """Exact accuracy of ``sign(w1 x1 + w2 x2)`` on the noise-free toy where ``x2`` has the label's sign with
    probability ``p_align`` (0.7 in distribution, 0.3 out of it): ``p q(w1, w2) + (1 - p) q(w1, -w2)`` with
    ``q(a, b) = P(a U1 + b U2 > 0)``. For ``w1, w2 > 0`` the errors need a misaligned ``x2``, so the OOD error is
    ``p / (1 - p)`` = 7/3 times the ID error (:func:`toy_ood_error`).

    Example:
        >>> tuple(round(toy_accuracy(1.0, w2, p), 4) for w2, p in ((0.4, 0.7), (0.4, 0.3), (0.0, 0.3)))
        (0.94, 0.86, 1.0)
    """
    return p_align * _positive(w1, w2) + (1 - p_align) * _positive(w1, -w2)


def toy_ood_error(id_error: float, p_align: float = 0.7) -> float:
    """The noise-free toy's OOD error of a boundary ``w1, w2 > 0`` from its ID error: ``id_error p / (1 - p)``.

    Example:
        >>> round(toy_ood_error(0.06), 4)
        0.14
    """
    return id_error * p_align / (1 - p_align)
