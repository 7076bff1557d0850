"""The gradient feature learning framework (Shi 2024, Ch. 3 = Zhenmei Shi, Junyi Wei, Yingyu Liang, "Provable
Guarantees for Neural Networks via Gradient Feature Learning", NeurIPS 2023, arXiv:2310.20582): its quantities,
measured.

At a symmetric initialisation the network outputs 0, so the first gradient of neuron i is ``l'(0) a_i
G(w_i, b_i)`` with the simplified gradient ``G(w, b) = E[y x 1[<w, x> > b]]`` (Definition 3.5). A direction D is
a gradient feature (Definition 3.7) when ``G(w, b)`` of a random initial neuron falls in the cone ``|<G, D>| >
(1 - gamma) ||G||`` with ``||G|| >= B_G`` with probability at least p (per bias sign s). Lemma 3.13: after the first
step, at least ``m p / 4`` neurons of each sign are "nice" for each such feature: their weight ``w^(1) = -eta l'(0)
a^(0) G`` points into the one-sided cone of D with ``||w^(1)|| >= |eta a^(0)| B_G`` (Eq. 3.14, Definition B.4).

Example:
    >>> x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    >>> y = torch.tensor([1.0, 1.0, -1.0, -1.0])
    >>> tuple(simplified_gradients(torch.tensor([[1.0, 0.1]]), torch.tensor([0.5]), x, y)[0].tolist())
    (0.25, 0.0)
"""
from __future__ import annotations

import math

import torch

from featlearn.errors import ConfigError


def xor_bias(d: int, sigma_w: float, sigma: float) -> float:
    """The XOR mixture's bias scale ``b~ = sqrt(d log log d) sigma_w sigma`` (App. B.5.3)."""
    if d < 16:
        raise ConfigError("d", "at least 16 (log log d > 0)", d)
    return math.sqrt(d * math.log(math.log(d))) * sigma_w * sigma


def simplified_gradients(W: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``G(w_i, b_i) = mean_n y x 1[<w_i, x> > b_i]`` for each row of ``W`` ``[m, d]`` over samples ``x [n, d]``,
    ``y [n]``: ``[m, d]`` (one mask, one GEMM)."""
    active = (x @ W.T > b).to(x.dtype)  # [n, m]
    return (active * y.unsqueeze(1)).T @ x / len(x)


def cone_cosines(G: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """``<G_i, D_j> / ||G_i||`` ``[m, J]`` (signed; Definition 3.7's cone takes its absolute value)."""
    return G @ directions.T / G.norm(dim=1, keepdim=True).clamp_min(1e-30)


def feature_probability(G: torch.Tensor, directions: torch.Tensor, gamma: float, B_G: float) -> torch.Tensor:
    """The share of initial neurons whose ``G`` is in the cone of each direction with norm at least ``B_G``
    (Definition 3.7's p for one bias sign: pass the neurons of that sign): ``[J]``."""
    if not 0 < gamma < 1:
        raise ConfigError("gamma", "in (0, 1)", gamma)
    inside = cone_cosines(G, directions).abs() > 1 - gamma
    return (inside & (G.norm(dim=1, keepdim=True) >= B_G)).to(G.dtype).mean(0)


def nice_counts(W1: torch.Tensor, scale: torch.Tensor, directions: torch.Tensor, gamma: float, B_G: float) -> torch.Tensor:
    """Eq. 3.14 / Definition B.4: how many first-step weights ``W1`` ``[m, d]`` point into the one-sided cone of
    each direction (``<w, D> > (1 - gamma) ||w||``) with ``||w|| >= scale_i B_G`` (``scale = |eta^(1) l'(0)
    a^(0)|``): ``[J]``."""
    inside = cone_cosines(W1, directions) > 1 - gamma
    return (inside & (W1.norm(dim=1, keepdim=True) >= scale.unsqueeze(1) * B_G)).sum(0)


def sparsest_readout(h_fit: torch.Tensor, y_fit: torch.Tensor, h_test: torch.Tensor, y_test: torch.Tensor,
                     order: torch.Tensor, slack: float = 0.01) -> tuple[int, float, float]:
    """The lottery ticket after step 1 (Lemma 3.14): the fewest neurons, taken in ``order`` (best first), whose
    readout (the L2-SVM of :func:`~featlearn.theory.two_layer.best_linear_classifier` on ``h_fit``) has a test error
    within ``slack`` of the readout on all of them. Returns ``(size, its error, the full readout's error)``; sizes
    tried: powers of two, then all."""
    from featlearn.theory.two_layer import best_linear_classifier

    def error(columns: torch.Tensor) -> float:
        a = best_linear_classifier(h_fit[:, columns], y_fit, ridge=1e-6)
        return float(((h_test[:, columns].double() @ a) * y_test.double() <= 0).double().mean())

    full = error(order)
    sizes = [2 ** k for k in range(int(math.log2(len(order))) + 1) if 2 ** k < len(order)] + [len(order)]
    for size in sizes:
        err = error(order[:size])
        if err <= full + slack:
            return size, err, full
    return len(order), full, full
