"""Closed-form quantities of the mask-reconstruction pretraining theory (Pan et al. 2023, Sec. 3.2, Thm 1).

* :func:`teacher_scale`: the teacher's scale ``tau`` of teacher-student MRP;
* :func:`lottery_factor` and :func:`capture_stats`: the lottery sets and captured features the theorems
  talk about, from the neuron x feature correlations ``C = W V^T``.

Example:
    >>> teacher_scale(theta=0.5, C_p=1, c_tau=0.0, step=0, q=3)
    2.0
"""
import math

import torch


def teacher_scale(theta: float, C_p: int, c_tau: float, step: int, q: int) -> float:
    """``tau = 1 + (1 - theta) / (C_p theta) + c_tau / (t^(1/q) + 1)`` at step ``t`` (Pan et al.
    2023, Assumption C.2, which leaves ``c_tau`` open; ``c_tau = 0``: constant)."""
    return 1 + (1 - theta) / (C_p * theta) + c_tau / (step ** (1 / q) + 1)


def lottery_factor(k: int) -> float:
    """Share of the best initial correlation that puts a kernel in a feature's lottery set ``M0_f``:
    ``1 - 1/ln k`` (``k >= 3``; smaller ``k`` use ``k = 3``)."""
    return 1.0 - 1.0 / math.log(max(k, 3))


def capture_stats(C: torch.Tensor, C0: torch.Tensor, feature_class: torch.Tensor, threshold: float,
                  lottery_factor: float) -> dict[str, torch.Tensor]:
    """The quantities of Pan et al. 2023, Thm 1 and Lemma C.1, from correlations ``C = W V^T`` ``[R, F]`` and
    their initial values ``C0``.

    * ``lambda/{min,median,max}``: ``Lambda_f = max_r [<w_r, v_f>]_+`` over the features;
    * ``frac_captured``: share of features with ``Lambda_f >= threshold``;
    * ``classes_both`` / ``classes_one``: share of classes with both / exactly one feature captured
      (Lemma 1: supervised learning captures about one feature per class);
    * ``kernels/{pure,sameclass,crossclass}``: capturing kernels holding one feature, both features of
      one class, or features of several classes;
    * ``winner_in_m0_frac``: share of captured features won by a kernel of their initial lottery set
      ``M0_f = {r : <w_r(0), v_f> >= Lambda_f(0) lottery_factor}``; ``m0_size/{mean,max}``: its size.

    Example:
        >>> C = torch.tensor([[0.9, 0.0], [0.0, 0.1]])
        >>> capture_stats(C, C, torch.tensor([0, 1]), 0.25, 0.5)["frac_captured"].item()
        0.5
    """
    lam = C.clamp_min(0).max(0).values
    captured = lam >= threshold
    holds = C >= threshold                                                  # [R, F]
    n_held = holds.sum(1)
    classes_held = torch.zeros(C.shape[0], int(feature_class.max()) + 1, device=C.device)
    classes_held.index_add_(1, feature_class.to(C.device), holds.float())
    n_classes = (classes_held > 0).sum(1)
    lottery = C0 >= C0.clamp_min(0).max(0).values * lottery_factor         # [R, F]
    winner = C.argmax(0)
    in_lottery = lottery.gather(0, winner[None]).squeeze(0)
    n_captured = captured.sum().clamp_min(1)
    per_class = torch.zeros(classes_held.shape[1], device=C.device).index_add_(
        0, feature_class.to(C.device), captured.float())
    return {
        "lambda/min": lam.min(), "lambda/median": lam.median(), "lambda/max": lam.max(),
        "frac_captured": captured.float().mean(),
        "classes_both": (per_class == 2).float().mean(), "classes_one": (per_class == 1).float().mean(),
        "kernels/pure": (n_held == 1).sum().float(),
        "kernels/sameclass": ((n_held > 1) & (n_classes == 1)).sum().float(),
        "kernels/crossclass": (n_classes > 1).sum().float(),
        "winner_in_m0_frac": (in_lottery & captured).sum() / n_captured,
        "m0_size/mean": lottery.sum(0).float().mean(), "m0_size/max": lottery.sum(0).float().max(),
    }
