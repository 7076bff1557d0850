"""Feature-learning quantities of contrastive learning on sparse coding (Wen & Li 2021, Sec. 3, App. B-E).

From the weights ``W [m, d1]``, biases ``b [m]`` and the dictionary ``M [d1, d]``: the atom coefficients
``alpha_ij = <w_i, M_j>``, the sparse-energy fraction ``rho_i = ||M^T w_i||^2 / ||w_i||^2``, the active sets
``N_i`` (:func:`active_threshold`), singleton neurons (``|N_i| = 1``) and the atoms they cover; and the
downstream view of a representation ``f`` (Wen & Li 2021, Def. 3.1, Cor. 3.3 and 3.5): linear probes of ``y = <w*, z>``
on ``f(x)`` vs raw ``x``, and how close ``f(x)`` is to ``f(Mz)`` (the sparse signal) and to ``f(xi)`` (the noise).
Everything stays a tensor on the weights' device; callers move what they log to the host once.

Example:
    >>> M = torch.eye(4)[:, :2]                      # d1 = 4, d = 2 atoms
    >>> w = torch.tensor([[1.0, 0.0, 0.1, 0.0], [0.0, 1.0, 0.0, 0.0]])
    >>> s = feature_scalars(feature_metrics(w, torch.zeros(2), M, 1.0))
    >>> int(s["features/singletons"]), float(s["features/coverage"])
    (2, 1.0)
"""
from __future__ import annotations

import math

import torch

from featlearn.metrics.features import mean_cosine
from featlearn.metrics.probes import logistic_probe, ridge_probe

__all__ = ["grown_bias", "active_threshold", "feature_metrics", "feature_scalars", "feature_histograms",
           "downstream_metrics", "EVAL_KEYS", "tags"]

EVAL_KEYS = ("x", "xi", "y_reg", "y_cls")
"""What :func:`downstream_metrics` needs of an evaluation split."""


def grown_bias(bias: torch.Tensor, norm: torch.Tensor, prev_norm: torch.Tensor, min_rate: float,
               cap_ratio: float) -> torch.Tensor:
    """One step of the bias schedule after its reset (Wen & Li 2021, App. D.2, with our cap): ``b_i`` grows by
    ``max(min_rate, ||w_i^{t+1}|| / ||w_i^t|| - 1)``, up to ``cap_ratio ||w_i||``; a bias at the cap follows it.

    Example:
        >>> grown_bias(torch.tensor([0.1, 0.5]), torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]), 0.1, 0.4).tolist()
        [0.11..., 0.4...]
    """
    rate = torch.clamp_min(norm / prev_norm.clamp_min(1e-30) - 1.0, min_rate)
    cap = cap_ratio * norm
    return torch.where(bias < cap, torch.minimum(bias * (1 + rate), cap), cap)


def advance_stages(stages: torch.Tensor, norm_T1: torch.Tensor, rho: torch.Tensor, norm: torch.Tensor, d: int,
                   step: int) -> torch.Tensor:
    """The stage clocks of Wen & Li 2021 after ``step``, in place and on the device (no host sync): ``stages =
    [T1, T2]`` (-1: not yet) and ``norm_T1`` (each ``||w_i||`` at T1). T1 is the first step with ``min_i rho_i
    >= 1/2``; T2 the first after it with ``max_i ||w_i||^2 / ||w_i(T1)||^2 >= d``. Returns whether T1 is
    ``step`` (a bool tensor: the bias schedule's reset).

    Example:
        >>> stages, norm_T1 = torch.tensor([-1, -1]), torch.zeros(2)
        >>> bool(advance_stages(stages, norm_T1, torch.tensor([0.6, 0.5]), torch.ones(2), 4, 7)), stages.tolist()
        (True, [7, -1])
    """
    at_t1 = (stages[0] < 0) & (rho.min() >= 0.5)
    stages[0] = torch.where(at_t1, step, stages[0])
    norm_T1.copy_(torch.where(at_t1, norm, norm_T1))
    at_t2 = (stages[0] >= 0) & (stages[1] < 0) & ((norm ** 2 / norm_T1.clamp_min(1e-30) ** 2).max() >= d)
    stages[1] = torch.where(at_t2, step, stages[1])
    return at_t1


def active_threshold(bias: torch.Tensor, norm: torch.Tensor, d: int) -> torch.Tensor:
    """Per-neuron threshold of the active sets ``N_i = {j : |alpha_ij| >= max(b_i, sqrt(2 log d/d) ||w_i||)}``.

    One definition for every bias mode, so singleton counts compare across settings: an atom must both
    pass the bias (the neuron fires on it alone) and stand out of the ``sqrt(2 log d / d)``
    level that the largest of ``d`` random coefficients reaches. The schedule's reset puts ``b`` exactly
    at that level (beta0 = 1), so after T1 the bias decides; for ``b <= 0`` (linear control, a learned
    bias gone negative) the norm level does, the level of Wen & Li 2021, Thm C.1.

    Example:
        >>> active_threshold(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0]), 32).tolist()  # doctest: +ELLIPSIS
        [0.93..., 1.0]
    """
    return torch.maximum(bias.float(), math.sqrt(2 * math.log(d) / d) * norm.float())


@torch.no_grad()
def feature_metrics(w: torch.Tensor, bias: torch.Tensor, M: torch.Tensor, temperature: float) -> dict:
    """The quantities of Wen & Li 2021, Thm 3.4 and App. B-E, from weights ``[m, d1]``, biases ``[m]`` and dictionary
    ``[d1, d]``, as tensors.

    ``alpha [m, d]``, ``norm [m]``, ``sparse_frac [m]`` (rho_i), ``top_align [m]``, ``active [m, d]`` (the
    sets N_i), ``N_size [m]``, ``singleton [m]``, ``covered [d]`` (atoms in the set of a singleton),
    ``multiplicity [d]``, ``F_over_taulogd [d]`` (NaN for atoms in no N_i), ``bias_ratio [m]``.
    """
    d = M.shape[1]
    alpha = w.float() @ M.float()
    norm2 = (w.float() ** 2).sum(1).clamp_min(1e-30)
    active = alpha.abs() >= active_threshold(bias, norm2.sqrt(), d).unsqueeze(1)
    sizes = active.sum(1)
    singleton = sizes == 1
    covered = (active & singleton.unsqueeze(1)).any(0)
    multiplicity = active.sum(0)
    energy = ((alpha ** 2) * active).sum(0)
    return {
        "alpha": alpha, "norm": norm2.sqrt(), "sparse_frac": (alpha ** 2).sum(1) / norm2,
        "top_align": alpha.abs().amax(1) / norm2.sqrt(), "active": active, "N_size": sizes,
        "singleton": singleton, "covered": covered, "multiplicity": multiplicity,
        "F_over_taulogd": torch.where(multiplicity > 0, energy / (temperature * math.log(d)), torch.nan),
        "bias_ratio": bias / norm2.sqrt(),
    }


def feature_scalars(fm: dict) -> dict[str, torch.Tensor]:
    """The scalars of :func:`feature_metrics` that a run logs, as 0-dim float tensors."""
    feat = fm["F_over_taulogd"]
    feat = feat[~feat.isnan()]
    return {
        "weights/norm_mean": fm["norm"].mean(), "weights/norm_max": fm["norm"].max(),
        "weights/sparse_frac_mean": fm["sparse_frac"].mean(), "weights/sparse_frac_min": fm["sparse_frac"].min(),
        "weights/sparse_frac_max": fm["sparse_frac"].max(), "weights/top_align_mean": fm["top_align"].mean(),
        "features/singletons": fm["singleton"].sum().float(), "features/coverage": fm["covered"].float().mean(),
        "features/max_multiplicity": fm["multiplicity"].max().float(),
        "features/F_over_taulogd_mean": feat.mean() if feat.numel() else feat.new_zeros(()),
        "bias/ratio_mean": fm["bias_ratio"].mean(),
    }


@torch.no_grad()
def downstream_metrics(encode, train: dict, test: dict, ridge: float, max_samples: int) -> dict[str, float]:
    """Probes of ``encode`` fitted on ``train`` and scored on ``test`` (dicts of :data:`EVAL_KEYS`, at most
    ``max_samples`` of each), beside the same probes on raw ``x``, and the geometry of ``f`` on ``test``."""
    train = {k: v[:max_samples] for k, v in train.items()}
    test = {k: v[:max_samples] for k, v in test.items()}
    ftr, fte = encode(train["x"]), encode(test["x"])
    out = {
        "probe/reg_nmse": ridge_probe(ftr, train["y_reg"], fte, test["y_reg"], ridge),
        "probe/reg_nmse_raw": ridge_probe(train["x"], train["y_reg"], test["x"], test["y_reg"], ridge),
        "probe/cls_acc": logistic_probe(ftr, train["y_cls"], fte, test["y_cls"]),
        "probe/cls_acc_raw": logistic_probe(train["x"], train["y_cls"], test["x"], test["y_cls"]),
    }
    f_sig, f_xi = encode(test["x"] - test["xi"]), encode(test["xi"])
    geometry = {"repr/cos_fx_fMz": mean_cosine(fte, f_sig), "repr/cos_fx_fxi": mean_cosine(fte, f_xi),
                "repr/dist_fx_fMz": (fte - f_sig).norm(dim=-1).mean(), "repr/norm_fMz": f_sig.norm(dim=-1).mean(),
                "act/fire_rate_raw": (fte != 0).float().mean()}
    out.update(zip(geometry, torch.stack(list(geometry.values())).tolist()))
    return out


def feature_histograms(w: torch.Tensor, bias: torch.Tensor, M: torch.Tensor, tau: float) -> dict[str, torch.Tensor]:
    """The logged histograms' values by tag: rho_i, ``|alpha_ij| / ||w_i||`` and ``|N_i|``; a tag whose values are
    not all finite is left out (a diverging run's NaNs have no histogram; its guard stops it)."""
    fm = feature_metrics(w, bias, M, tau)
    values = {"weights/sparse_frac": fm["sparse_frac"],
              "weights/alpha_abs": fm["alpha"].abs() / fm["norm"].unsqueeze(1),
              "features/N_i_size_hist": fm["N_size"].float()}
    return {tag: v for tag, v in values.items() if torch.isfinite(v).all()}


def tags(section: str, metrics: dict) -> dict:
    """The logger's names of a metrics dict: ``<section>/<key>`` lower-cased (the module's own dicts keep their
    keys, which tables and sweeps read).

    Example:
        >>> tags("theory", {"stage/T1": 3.0, "features/coverage": 1.0})
        {'theory/stage/t1': 3.0, 'theory/features/coverage': 1.0}
    """
    return {f"{section}/{key.lower()}": value for key, value in metrics.items()}
