"""Closed forms of Shi 2024, Ch. 2 (Shi, Wei & Liang 2022): the F_Xi data family's constants, the three-stage
schedule of Theorem A.20 (and its Lemma A.17 / Theorem A.28 variants), the
feature-recovery metric, the MDS picture of the neurons and the fixed-feature lower bound.

Everything is a plain function of numbers or tensors; nothing reads a DataModule or a LightningModule.

* The labels of F_Xi depend on the hidden vector only through ``S = sum_{j in A} phi_j``. A distribution
  is a table ``P(c, S)`` over mixture components ``c`` (:func:`component_tables`) plus each component's
  background Bernoulli probability; :func:`data_constants` derives the label probabilities, the
  analytic mean and variance ``sigma~^2`` of the normalisation, and the label correlation ``gamma``.
* :func:`theory_schedule`: step sizes, regularisation and smoothing of the three stages.
* :func:`cos_sim`: ``max_i cos(w_i, sum_{j in A} M_j)``; :func:`centre_coverage`: per Gaussian centre of
  the hypercube mixture, the best neuron's cosine; :func:`mds_embedding`: classical MDS of the cosine
  distances between neuron directions.
* :func:`best_linear_classifier`: the One / Two Step probes' "best classifier" on frozen hidden features,
  solved to convergence.

Example:
    >>> c = data_constants("parity", k=5, num_patterns=100, p_o=0.5)
    >>> round(c["gamma"], 6), round(c["sigma2"], 6), round(c["mean_y"], 12)
    (0.25, 25.0, 0.0)
    >>> s = theory_schedule(k=5, m=300, gamma=0.25, sigma_tilde=5.0, steps=600)
    >>> f"{s['lr1']:.3g}", s["smoothing1"], f"{s['lr3']:.3g}", f"{s['reg3']:.3g}"
    ('1.16e-08', 0.04, '0.00622', '3.73')
"""
from __future__ import annotations

import math

import torch

LABELINGS = ("parity", "interval", "hypercube_mog")
SCHEDULES = ("A20", "A17", "A28", "plain")


def _binomial(k: int, p: float) -> list[float]:
    return [math.comb(k, s) * p ** s * (1 - p) ** (k - s) for s in range(k + 1)]


def label_of_sum(labeling: str, k: int, low: int = 20, high: int = 30) -> list[int]:
    """``y(S)`` in {-1, +1} for ``S = 0..k``: parity (``S`` odd, k odd), interval (``low <= S <= high``),
    hypercube_mog (``prod eps_i = (-1)^(k - S)`` with ``S`` the number of ``eps_i = +1``).

    Example:
        >>> label_of_sum("parity", 3), label_of_sum("hypercube_mog", 2)
        ([-1, 1, -1, 1], [1, -1, 1])
    """
    if labeling == "parity":
        return [1 if s % 2 else -1 for s in range(k + 1)]
    if labeling == "interval":
        return [1 if low <= s <= high else -1 for s in range(k + 1)]
    return [1 if (k - s) % 2 == 0 else -1 for s in range(k + 1)]


def component_tables(labeling: str, k: int, p_o: float = 0.5, structure: bool = True,
                     relevant_prob: float = 2 / 3) -> tuple[list[list[float]], list[float]]:
    """``(P(c, S) [C][k + 1], background probability q_c [C])`` of the hidden vector (Shi 2024, Sec. 2.3 and App. A.7).

    * parity with structure: ``D_mix = p_o D^(0) + (1 - p_o) D^(1)``; ``D^(0)`` uniform (S ~ Bin(k, 1/2),
      q = 1/2), ``D^(1)``: ``phi_A`` all zeros or all ones, background ``Bern(p_o / (2 - 2 p_o))``;
    * interval with structure: ``phi_A ~ Bern(relevant_prob)`` i.i.d., background ``Bern(p_o)``;
    * no structure (F_Xi0) and hypercube_mog: everything ``Bern(1/2)``.

    Example:
        >>> joint, q = component_tables("parity", 3, 0.5)
        >>> [round(v, 4) for v in joint[1]], q
        ([0.25, 0.0, 0.0, 0.25], [0.5, 0.5])
    """
    if not structure or labeling == "hypercube_mog":
        return [_binomial(k, 0.5)], [0.5]
    if labeling == "interval":
        return [_binomial(k, relevant_prob)], [p_o]
    ends = [0.0] * (k + 1)
    ends[0] = ends[k] = 0.5
    return ([[p_o * v for v in _binomial(k, 0.5)], [(1 - p_o) * v for v in ends]],
            [0.5, p_o / (2 - 2 * p_o)])


def sampling_table(joint: list[list[float]], labels: list[int], neg_fraction: float | None) -> list[list[float]]:
    """The table the sampler draws ``(c, S)`` from: ``joint`` itself, or with ``Pr[y = -1] = neg_fraction``
    (the conditional law of ``(c, S)`` given each class unchanged, i.e. sub-sampling one class)."""
    if neg_fraction is None:
        return joint
    mass = {v: sum(row[s] for row in joint for s in range(len(labels)) if labels[s] == v) for v in (-1, 1)}
    want = {-1: neg_fraction, 1: 1 - neg_fraction}
    return [[row[s] * want[labels[s]] / mass[labels[s]] for s in range(len(labels))] for row in joint]


def data_constants(labeling: str, k: int, num_patterns: int, p_o: float = 0.5, structure: bool = True,
                   relevant_prob: float = 2 / 3, low: int = 20, high: int = 30, neg_fraction: float | None = None,
                   mog_noise: float = 1.0, dim: int = 500) -> dict:
    """Population constants of the sampled distribution.

    Returns ``table`` (``P(c, S)``), ``background`` (``q_c``), ``labels`` (``y(S)``), ``prob_pos``
    (``Pr[y = +1]``), ``mean_y``, ``mean_A`` / ``mean_bg`` (``E phi_j`` on / off A), ``sigma2`` (the
    normalisation's ``sigma~^2 = E ||x~ - E x~||^2``), ``gamma`` (``E[y phi_i] - E[y] E[phi_i]``, i in A)
    and ``p_min`` (the smaller class probability). For hypercube_mog ``x~ = sum eps_i M_i + g`` with
    ``g ~ N(0, mog_noise^2 (k/d) I_d)``: mean 0 and ``sigma2 = k (1 + mog_noise^2)``.

    Example:
        >>> c = data_constants("interval", k=30, num_patterns=100, p_o=0.5, relevant_prob=2/3)
        >>> round(c["prob_pos"], 3), round(c["gamma"], 3), round(c["sigma2"], 2)
        (0.585, 0.068, 24.17)
    """
    joint, background = component_tables(labeling, k, p_o, structure, relevant_prob)
    labels = label_of_sum(labeling, k, low, high)
    table = sampling_table(joint, labels, neg_fraction)
    marg = [sum(row[s] for row in table) for s in range(k + 1)]
    prob_pos = sum(p for p, y in zip(marg, labels) if y > 0)
    mean_y = 2 * prob_pos - 1
    mean_s = sum(s * p for s, p in enumerate(marg))
    mean_ys = sum(y * s * p for s, (p, y) in enumerate(zip(marg, labels)))
    mean_a = mean_s / k
    mean_bg = sum(sum(row) * q for row, q in zip(table, background))
    if labeling == "hypercube_mog":
        sigma2 = k * (1 + mog_noise ** 2)
    else:
        sigma2 = k * mean_a * (1 - mean_a) + (num_patterns - k) * mean_bg * (1 - mean_bg)
    return {"table": table, "background": background, "labels": labels, "prob_pos": prob_pos, "mean_y": mean_y,
            "mean_A": mean_a, "mean_bg": mean_bg, "sigma2": sigma2, "gamma": mean_ys / k - mean_y * mean_a,
            "p_min": min(prob_pos, 1 - prob_pos)}


def theory_schedule(k: int, m: int, gamma: float, sigma_tilde: float, steps: int, variant: str = "A20",
                    p_min: float = 0.5, lr1_mult: float = 1.0, smoothing_mult: float = 1.0, lr3_mult: float = 1.0,
                    reg3_mult: float = 1.0, lr3a_mult: float | None = None) -> dict[str, float]:
    """The three stages of Shi 2024, Theorem A.20 for ``2m`` neurons and ``steps`` = T steps in all.

    * step 1: ``lr1 = gamma^2 sigma~^2 / (k m^3)``, ``lambda_a = 0``, ``lambda_w = 1/(2 lr1)`` (w is erased
      and replaced by ``-lr1 grad_w L``), smoothing ``1/k^2``;
    * step 2: ``lr = 1``, ``lambda_a = lambda_w = 1/2`` (a and w replaced by ``-grad L``), smoothing ``1/k^2``;
    * steps 3..T: ``lr3 = k^2 / (T m^(1/3))``, ``lambda = k^3 / (sigma~ m^(1/3))`` (the theorem's upper
      bound), no smoothing.

    ``variant="A17"``: ``lr1 = gamma^2 sigma~ / (k m^3)`` and smoothing ``1/k^(3/2)`` (Lemma A.17);
    ``"A28"``: ``lr1 = gamma^2 p_min sigma~ / (k m^3)``, smoothing ``1/k^(3/2)`` (Theorem A.28);
    ``"plain"``: no feature-learning steps, every step is a stage-3 step (the "typical practice" training
    of the mixture-of-Gaussians runs, App. A.7.3, where gamma = 0 leaves steps 1-2 undefined). The
    multipliers scale ``lr1``, the stage-1/2 smoothing, ``lr3`` and ``lambda`` (the experiments of the
    paper do not print their values); ``lr3a`` is the second layer's stage-3 step, ``lr3a_mult``
    (None: ``lr3_mult``) times the same eta: the proof's stage 3 (Lemma A.18) is a convex problem in ``a`` alone, whose margin needs
    ``|a_i|`` far above what eta (T - 2) ~ 3.7 reaches, while the first layer cannot take such steps.
    """
    if variant == "plain":
        lr1, smooth = 0.0, 0.0
    elif variant == "A20":
        lr1, smooth = gamma ** 2 * sigma_tilde ** 2 / (k * m ** 3), 1 / k ** 2
    elif variant == "A17":
        lr1, smooth = gamma ** 2 * sigma_tilde / (k * m ** 3), 1 / k ** 1.5
    else:
        lr1, smooth = gamma ** 2 * p_min * sigma_tilde / (k * m ** 3), 1 / k ** 1.5
    cube = m ** (1 / 3)
    eta3 = k ** 2 / (steps * cube)
    return {"lr1": lr1 * lr1_mult, "smoothing1": smooth * smoothing_mult, "lr2": 1.0, "reg2": 0.5,
            "smoothing2": smooth * smoothing_mult, "lr3": eta3 * lr3_mult,
            "lr3a": eta3 * (lr3_mult if lr3a_mult is None else lr3a_mult),
            "reg3": k ** 3 / (sigma_tilde * cube) * reg3_mult}


def hinge(margin: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean hinge loss ``max(1 - y g, 0)`` of the margins ``y g`` (optionally class-weighted per sample).

    Example:
        >>> hinge(torch.tensor([2.0, 0.5, -1.0])).item()
        0.8333333134651184
    """
    loss = torch.clamp_min(1 - margin, 0)
    return loss.mean() if weight is None else (loss * weight).mean()


def cos_sim(w: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """``max_i cos(w_i, direction)`` over the rows of ``w [n, d]`` (zero rows count as cosine 0).

    Example:
        >>> cos_sim(torch.tensor([[1.0, 1.0], [0.0, 2.0]]), torch.tensor([0.0, 1.0])).item()
        1.0
    """
    norms = w.norm(dim=1) * direction.norm()
    return torch.where(norms > 0, (w @ direction) / norms.clamp_min(1e-300), torch.zeros_like(norms)).max()


def centre_coverage(w: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """``[C]``: for each centre ``c`` (a row of ``centres [C, d]``), ``max_i cos(w_i, c)`` over the rows of
    ``w [n, d]``; the mixture-of-Gaussians runs expect every centre to be covered by some neurons (App. A.7.3).

    Example:
        >>> centres = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
        >>> [round(v, 4) for v in centre_coverage(torch.tensor([[2.0, 2.0], [0.0, -1.0]]), centres).tolist()]
        [1.0, 0.7071, 0.0, 0.7071]
    """
    u = w / w.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return ((centres / centres.norm(dim=1, keepdim=True)) @ u.T).max(1).values


def best_linear_classifier(h: torch.Tensor, y: torch.Tensor, ridge: float = 1e-8, tol: float = 1e-10,
                           max_iter: int = 100) -> torch.Tensor:
    """The weights ``a`` minimising ``mean(max(0, 1 - y <a, h>)^2) + ridge ||a||^2`` (the L2-SVM on the
    features ``h [n, p]``, labels ``y`` in {-1, +1}, no intercept), by Newton's method on the generalised
    Hessian with a backtracking line search, in float64, until the Newton decrement is below ``tol``
    times the objective. A tiny ``ridge`` makes it the near-max-margin separator when one exists.

    Why not the network's own steps: the One / Two Step probes are "the best classifiers" on the frozen
    hidden layer (App. A.7.1); plain gradient steps on these features are ill-conditioned (the parity's
    components sit in directions 1000x weaker than the threshold rule's) and stop far from the optimum.

    Example:
        >>> h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
        >>> a = best_linear_classifier(h, torch.tensor([1.0, -1.0, 1.0]))
        >>> [round(v, 4) for v in a.tolist()]
        [2.0, -1.0]
    """
    h, y = h.double(), y.double()
    n, p = h.shape
    a = torch.zeros(p, dtype=torch.float64, device=h.device)
    eye = torch.eye(p, dtype=torch.float64, device=h.device)

    def objective(v):
        r = (1 - y * (h @ v)).clamp_min(0)
        return float((r * r).mean() + ridge * (v @ v))

    f = objective(a)
    for _ in range(max_iter):
        r = 1 - y * (h @ a)
        act = r > 0
        ha = h[act]
        grad = -2 / n * (ha.T @ (y[act] * r[act])) + 2 * ridge * a
        step = torch.linalg.solve(2 / n * (ha.T @ ha) + 2 * ridge * eye, -grad)
        decrement = float(-(grad @ step))
        if decrement <= 2 * tol * max(f, 1e-300):
            break
        t = 1.0
        while True:  # Armijo: the squared hinge is only once differentiable, so a full Newton step may overshoot
            trial = objective(a + t * step)
            if trial <= f - 0.25 * t * decrement or t < 1e-12:
                break
            t /= 2
        a, f = a + t * step, trial
    return a


def mds_embedding(w: torch.Tensor, dims: int = 2) -> torch.Tensor:
    """Classical MDS of the cosine distances ``1 - cos(w_i, w_j)`` between the rows of ``w``: ``[n, dims]``
    coordinates whose Euclidean distances best match them (double centring, top eigenvectors).

    Example:
        >>> w = torch.tensor([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
        >>> xy = mds_embedding(w)
        >>> round(float((xy[0] - xy[1]).norm()), 6), round(float((xy[0] - xy[2]).norm()), 6) > 0
        (0.0, True)
    """
    u = w.double() / w.double().norm(dim=1, keepdim=True).clamp_min(1e-300)
    dist2 = (1 - u @ u.T).clamp_min(0) ** 2
    n = dist2.shape[0]
    centre = torch.eye(n, dtype=dist2.dtype, device=dist2.device) - 1.0 / n
    gram = -0.5 * centre @ dist2 @ centre
    vals, vecs = torch.linalg.eigh(gram)
    top = vals.flip(0)[:dims].clamp_min(0)
    return vecs.flip(1)[:, :dims] * top.sqrt()


def fixed_feature_lower_bound(p_o: float, num_features: int, norm: float, k: int) -> float:
    """Theorem 2.2: a linear model on ``N`` fixed features with norm ``B`` has hinge loss at least
    ``p_o (1 - sqrt(2 N B) / 2^k)`` on F_Xi (odd ``3 < k <= D/16``); cited, not run.

    Example:
        >>> fixed_feature_lower_bound(0.5, 1, 0.5, 5)
        0.484375
    """
    return p_o * (1 - math.sqrt(2 * num_features * norm) / 2 ** k)
