"""Closed forms of the one-layer softmax ViT theory: MAE vs contrastive learning (Huang et al. 2025).

Everything here is a plain function of numbers or tensors; nothing reads a DataModule or a LightningModule.

* :func:`area_sizes`: the global / local area sizes from the exponents (our rounding of the
  paper's ``Theta(P^kappa)``) and the effective
  exponents and information gap ``Delta = (1 - kappa_s) - 2 (1 - kappa_c)``.
* :func:`init_values`: attention at ``Q = 0``.
* :func:`prob_fully_masked`, :func:`loss_floor`: the expected MAE floor ``1/2 E[z^2] P(area fully masked |
  p masked)``, per masked patch (our floor: the paper's ``L^low`` assumes no attention on masked keys); it
  bounds the expected loss, not one batch's: :func:`batch_loss_floor` is the bound of one batch.
* :func:`area_loss`: the closed-form MAE loss of Lemma D.8 from the unmasked area attention ``A_{p,m}``.
* :func:`mae_gradient_projections`: the exact correlation gradients of Lemmas D.1, D.3, D.4
  (``alpha``, ``beta``).
* :func:`cl_gradient_rows`: the exact CL gradient of Lemma J.2 on the query rows ``W = E Q``.
* :func:`eta_mae`: our learning-rate rule (the paper only asks ``eta << poly(P)``); :func:`cl_loss_floor`: the
  cluster-only optimum of the in-batch InfoNCE loss (the ``OPT = Theta(log(N_c/K))`` of Sec. 4).

Example:
    >>> s = area_sizes(256, kappa_c=0.875, kappa_s=0.5)
    >>> s["C_1"], s["C_s"], s["n_local"], s["delta"]
    (128, 16, 8, 0.25)
    >>> round(init_values(256, 128, 16, 192)["attn_own_local"], 5)   # (1 - gamma) C_s / P
    0.01562
"""
from __future__ import annotations

import math

import torch

from featlearn.errors import ConfigError

__all__ = ["information_gap", "area_sizes", "embedding_dim", "masked_count", "z_moments", "init_values",
           "prob_fully_masked", "loss_floor", "batch_loss_floor", "patch_vectors", "area_attention", "area_loss",
           "mae_gradient_projections", "cl_gradient_rows", "eta_mae", "cl_loss_floor", "attention_diversity",
           "init_loss"]


def information_gap(kappa_c: float, kappa_s: float) -> float:
    """``Delta = (1 - kappa_s) - 2 (1 - kappa_c)`` (eq. 4.1): > 0 means two-phase MAE learning of local areas.

    Example:
        >>> information_gap(0.625, 0.5)
        -0.25
    """
    return (1.0 - kappa_s) - 2.0 * (1.0 - kappa_c)


def area_sizes(P: int, kappa_c: float | None = None, kappa_s: float | None = None, C_1: int | None = None,
               C_s: int | None = None, c_c: float = 1.0, c_s: float = 1.0, prefix: str = "data") -> dict:
    """Global and local area sizes of one cluster (Huang et al. 2025, Def. 2.1, with our rounding).

    ``C_1 = round(c_c P^kappa_c)`` and ``C_s = round(c_s P^kappa_s)`` (or the explicit ``C_1`` / ``C_s``),
    ``N - 1 = floor((P - C_1) / C_s)`` local areas, and the ``P - C_1 - (N-1) C_s`` leftover patches join
    the global area. Refuses (naming ``<prefix>.<field>``) sizes that leave no local area, an empty local
    area, or a global area no larger than a local one.

    Returns ``C_1`` (after the leftover), ``C_s``, ``n_local``, ``n_areas = n_local + 1``, the effective
    exponents ``kappa_c_eff = ln C_1 / ln P`` and ``kappa_s_eff``, the nominal ``delta`` (from the
    exponents given, None with explicit sizes) and ``delta_eff`` (from the effective exponents).

    Example:
        >>> s = area_sizes(256, C_1=100, C_s=16)    # 9 local areas, 12 leftover patches join the global one
        >>> s["C_1"], s["n_local"], round(s["delta_eff"], 3)
        (112, 9, 0.202)
    """
    c1_field = "C_1" if C_1 is not None else "kappa_c"
    cs_field = "C_s" if C_s is not None else "kappa_s"
    if C_1 is None:
        if kappa_c is None:
            raise ConfigError(f"{prefix}.kappa_c", "a number in (0, 1] when C_1 is null", kappa_c)
        C_1 = int(math.floor(c_c * P ** kappa_c + 0.5))
    if C_s is None:
        if kappa_s is None:
            raise ConfigError(f"{prefix}.kappa_s", "a number in [0, 1) when C_s is null", kappa_s)
        C_s = int(math.floor(c_s * P ** kappa_s + 0.5))
    if C_s < 1:
        raise ConfigError(f"{prefix}.{cs_field}", f"large enough for a local area of at least one patch "
                                                  f"(C_s = {C_s})", kappa_s if cs_field == "kappa_s" else C_s)
    if C_1 < 1:
        raise ConfigError(f"{prefix}.{c1_field}", f"large enough for a global area of at least one patch "
                                                  f"(C_1 = {C_1})", kappa_c if c1_field == "kappa_c" else C_1)
    n_local = (P - C_1) // C_s
    if n_local < 1:
        if cs_field == "C_s" and c1_field == "kappa_c":  # the explicit size is the one to blame
            raise ConfigError(f"{prefix}.C_s", f"at most P - C_1 = {P - C_1} (room for one local area)", C_s)
        raise ConfigError(f"{prefix}.{c1_field}", f"small enough to leave room for a local area of C_s = {C_s} "
                                                  f"patches (C_1 = {C_1} of P = {P})",
                          kappa_c if c1_field == "kappa_c" else C_1)
    C_1 = P - n_local * C_s
    if C_1 <= C_s:
        raise ConfigError(f"{prefix}.{c1_field}", f"large enough for a global area larger than a local one (C_1 = {C_1}, "
                                                  f"C_s = {C_s})", kappa_c if c1_field == "kappa_c" else C_1)
    logP = math.log(P)
    kc_eff, ks_eff = math.log(C_1) / logP, math.log(C_s) / logP
    nominal = (information_gap(kappa_c, kappa_s) if c1_field == "kappa_c" and cs_field == "kappa_s" else None)
    return {"C_1": C_1, "C_s": C_s, "n_local": n_local, "n_areas": n_local + 1, "kappa_c_eff": kc_eff,
            "kappa_s_eff": ks_eff, "delta": nominal, "delta_eff": information_gap(kc_eff, ks_eff)}


def embedding_dim(P: int, n_features: int, multiple: int = 64) -> int:
    """The default ``d = roundup(P + sum_k N_k, multiple)`` (Assumption 2.3: positions and features
    orthonormal): positions, features, spare noise room.

    Example:
        >>> embedding_dim(256, 4 * 9)
        320
    """
    return -(-(P + n_features) // multiple) * multiple


def masked_count(P: int, ratio: float) -> int:
    """Exactly ``round(ratio P)`` masked patches (Def. 2.5 draws without replacement; the proofs use
    ``|U| = (1 - gamma) P``), halves rounded up.

    Example:
        >>> masked_count(256, 0.75), masked_count(10, 0.25)
        (192, 3)
    """
    return int(math.floor(ratio * P + 0.5))


def z_moments(law: str, low: float, high: float) -> tuple[float, float, float]:
    """``(E z, E z^2, E z^3)`` of the latent law: ``uniform`` on ``[low, high]`` or ``const`` (z = 1).

    Example:
        >>> [round(v, 4) for v in z_moments("uniform", 0.9, 1.1)]
        [1.0, 1.0033, 1.01]
    """
    if law == "const":
        return 1.0, 1.0, 1.0
    return tuple((high ** (j + 1) - low ** (j + 1)) / ((j + 1) * (high - low)) for j in (1, 2, 3))


def init_values(P: int, C_1: int, C_s: int, n_masked: int, masked_query: bool = False) -> dict[str, float]:
    """Expected attention at ``Q = 0`` (every ``attn_{p->q} = 1/P``) with ``n_masked`` masked patches.

    Over a query at any position (CL: every position queries): ``attn_own_local = (1 - gamma) C_s / P``,
    ``attn_own_global = (1 - gamma) C_1 / P``, the local queries' ``attn_glob_from_local = (1 - gamma) C_1 / P``
    (CL: ``A_1(X^+)``) and ``attn_to_masked = gamma``, ``gamma = n_masked / P``. ``masked_query`` (MAE): given
    that the query itself is masked, its own area keeps ``(C - 1)(P - n) / (P - 1)`` unmasked patches on average
    (``attn_own_local = 15 x 64 / 255 / 256 = 0.0147`` at P = 256, C_s = 16, gamma = 0.75, against 16/1024).

    Example:
        >>> round(init_values(256, 128, 16, 192, masked_query=True)["attn_own_local"], 5)
        0.01471
    """
    keep = 1.0 - n_masked / P

    def own(C):
        return (C - 1) * (P - n_masked) / ((P - 1) * P) if masked_query else keep * C / P

    glob = C_1 * (P - n_masked) / ((P - 1) * P) if masked_query else keep * C_1 / P
    return {"attn_own_local": own(C_s), "attn_own_global": own(C_1), "attn_glob_from_local": glob,
            "attn_to_masked": n_masked / P}


def prob_fully_masked(P: int, C: int, n_masked: int, given_masked: bool = True) -> float:
    """Probability that all ``C`` patches of an area are masked, ``n_masked`` of ``P`` masked uniformly
    without replacement; ``given_masked``: conditional on one given patch of the area being masked
    (``= P(all) / gamma``), the probability per masked patch.

    Example:
        >>> round(prob_fully_masked(256, 16, 192, given_masked=False), 5)   # Lemma D.7's bound: gamma^16 = 0.01
        0.00851
    """
    if n_masked < C:
        return 0.0
    if given_masked:
        return math.exp(_log_comb(P - C, n_masked - C) - _log_comb(P - 1, n_masked - 1))
    return math.exp(_log_comb(P - C, n_masked - C) - _log_comb(P, n_masked))


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def loss_floor(P: int, C_1: int, C_s: int, n_local: int, n_masked: int, Ez2: float,
               z_min: float | None = None) -> dict[str, float]:
    """The expected MAE floor per masked patch (ours): ``1/2 E[z^2] P(area fully masked | p masked)``.

    A lower bound of the *expected* loss only: one batch's loss can fall below it when the batch happens to
    hold fewer fully masked areas than the expectation (p256_pos_small, C_s = 4 at gamma = 0.5: a batch of 32
    holds ~93 fully masked local areas, sd ~9, so its bound has sd 0.004 around 0.046, and a trained run's
    batch loss of 0.0395 sits below 0.0459 yet above its own batch's bound). The bound of a given batch is
    :func:`batch_loss_floor`; this function is its expectation.

    A masked patch whose whole area is masked cannot be reconstructed: its best output is 0 (all attention
    on masked keys), error ``1/2 z^2``. With the masked keys out of the softmax (``z_min``, the smallest
    latent, given: the ``masked_keys="exclude"`` ablation) the attention must sum to 1 over the unmasked keys,
    all in the (at most ``N - 1 = n_local``) other areas, so the error is at least ``1/2 (z_a^2 + z_min^2 /
    n_local)`` there: the paper's ``L^low``. Returns ``floor_local`` and ``floor_global`` (per masked patch
    of each kind) and ``floor`` (averaged over all masked patches: areas weighted by their sizes).

    Example:
        >>> round(loss_floor(256, 128, 16, 8, 192, 1.0)["floor_local"], 4)
        0.0057
        >>> round(loss_floor(256, 128, 16, 8, 192, 1.0, z_min=1.0)["floor_local"], 4)   # x (1 + 1/8)
        0.0064
    """
    err = 0.5 * (Ez2 + (z_min ** 2 / n_local if z_min is not None else 0.0))
    local = err * prob_fully_masked(P, C_s, n_masked)
    glob = err * prob_fully_masked(P, C_1, n_masked)
    return {"floor_local": local, "floor_global": glob, "floor": (C_1 * glob + n_local * C_s * local) / P}


def batch_loss_floor(z_own: torch.Tensor, hidden: torch.Tensor, n_local: int,
                     z_min: float | None = None) -> torch.Tensor:
    """Per masked query ``[B, Pq]``, the least loss any attention can reach on this batch: ``1/2 z_a^2`` (with
    ``z_min``, the ``masked_keys="exclude"`` ablation: ``1/2 (z_a^2 + z_min^2 / n_local)``) where the query's
    area is fully masked (``hidden``), 0 elsewhere (Lemma D.8's loss with ``A_a = 0``). Its mean over the masked
    queries bounds that batch's loss per masked patch; its expectation is :func:`loss_floor`.

    Example:
        >>> batch_loss_floor(torch.tensor([[1.0, 2.0]]), torch.tensor([[False, True]]), 8).tolist()
        [[0.0, 2.0]]
    """
    err = 0.5 * (z_own.square() + (z_min ** 2 / n_local if z_min is not None else 0.0))
    return err * hidden.to(err.dtype)


def patch_vectors(feat_id: torch.Tensor, z: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Dense patches ``X_p = z_p v_{f(p)}`` ``[B, P, d]`` from the structured batch (feature row ids
    ``[B, P]`` into ``V [F, d]``, latents ``[B, P]``).

    Example:
        >>> patch_vectors(torch.tensor([[1, 0]]), torch.tensor([[2.0, 3.0]]), torch.eye(2)).tolist()
        [[[0.0, 2.0], [3.0, 0.0]]]
    """
    return V[feat_id] * z.unsqueeze(-1).to(V.dtype)


def area_attention(attn: torch.Tensor, area: torch.Tensor, unmasked: torch.Tensor, n_areas: int) -> torch.Tensor:
    """Unmasked area attention ``A_{p,m} = sum_{q in U, area(q) = m} attn_{p->q}`` ``[B, Pq, n_areas + 1]``
    from attention ``[B, Pq, P]``; the last column is the attention to masked keys."""
    groups = torch.where(unmasked, area, n_areas)
    out = torch.zeros(*attn.shape[:2], n_areas + 1, dtype=attn.dtype, device=attn.device)
    return out.scatter_add_(2, groups[:, None, :].expand_as(attn), attn)


def area_loss(A: torch.Tensor, z_area: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Lemma D.8 per masked query ``[B, Pq]``: ``1/2 (z_a^2 (1 - A_a)^2 + sum_{m != a} z_m^2 A_m^2)``.

    ``A [B, Pq, >= N]`` unmasked area attention (extra columns, e.g. masked keys, are ignored), ``z_area
    [B, N]`` latents, ``own [B, Pq]`` the area ``a`` of each query.

    Example:
        >>> A = torch.tensor([[[0.5, 0.25, 0.25]]])
        >>> area_loss(A, torch.tensor([[1.0, 2.0]]), torch.tensor([[0]])).tolist()   # (0.25 + 4/16) / 2
        [[0.25]]
    """
    N = z_area.shape[1]
    target = torch.nn.functional.one_hot(own, N).to(A.dtype)
    return 0.5 * (z_area.unsqueeze(1).square() * (A[..., :N] - target).square()).sum(-1)


def mae_gradient_projections(attn: torch.Tensor, query_pos: torch.Tensor, area: torch.Tensor,
                             unmasked: torch.Tensor, z_area: torch.Tensor, cluster: torch.Tensor,
                             n_clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact descent directions on one batch (Huang et al. 2025, Lemmas D.1, D.3, D.4), batch means:
    ``alpha = -dL/dPhi`` ``[P, K N]`` (column ``k N + m`` is ``v_{k,m}``) and ``beta = -dL/dUpsilon`` ``[P, P]``.

    ``attn [B, Pq, P]`` the masked queries' attention, ``query_pos [B, Pq]`` their positions, ``area [B, P]``
    the area of every position, ``unmasked [B, P]``, ``z_area [B, N]``, ``cluster [B]``. ``L`` is the
    minibatch loss ``1/2 mean_b sum_{p in M} ||F_p - X_p||^2``.

    * ``alpha_{p->v_{k,n}} = A_n (z_n^3 (1 - A_n)^2 + sum_{a != n} z_a^2 z_n A_a^2)`` for the own area n;
    * ``alpha_{p->v_{k,m}} = A_m (sum_{a != m,n} z_a^2 z_m A_a^2 - z_m z_n^2 (1 - A_n) A_n - z_m^3 (1 - A_m) A_m)``;
    * ``beta_{p->q} = attn_{p->q} (J_q - Jbar_p)``, ``J_q = z_n^2 (1 - A_n)`` on ``U cap P_n``, ``-z_m^2 A_m``
      on ``U cap P_m``, 0 on masked keys, ``Jbar_p = z_n^2 A_n (1 - A_n) - sum_{a != n} z_a^2 A_a^2``.
    """
    B, Pq, P = attn.shape
    N = z_area.shape[1]
    own = area.gather(1, query_pos)
    A = area_attention(attn, area, unmasked, N)[..., :N]                      # [B, Pq, N]
    onehot = torch.nn.functional.one_hot(own, N).to(attn.dtype)
    z = z_area.unsqueeze(1)                                                     # [B, 1, N]
    z_n = (z * onehot).sum(-1, keepdim=True)
    A_n = (A * onehot).sum(-1, keepdim=True)
    sq = z.square() * A.square()                                               # z_a^2 A_a^2
    others_n = sq.sum(-1, keepdim=True) - z_n.square() * A_n.square()          # sum_{a != n}
    alpha_own = A_n * (z_n ** 3 * (1 - A_n).square() + others_n * z_n)
    others_mn = others_n - sq                                                   # sum_{a != m, n}
    alpha_m = A * (others_mn * z - z * z_n.square() * (1 - A_n) * A_n - z ** 3 * (1 - A) * A)
    alpha_rows = torch.where(onehot.bool(), alpha_own.expand_as(A), alpha_m)   # [B, Pq, N]
    J_key = torch.where(area.unsqueeze(1) == own.unsqueeze(-1), 1.0, 0.0)      # [B, Pq, P]: key in own area
    z_key = z_area.gather(1, area).unsqueeze(1)                                # [B, 1, P]
    A_key = A.gather(2, area.unsqueeze(1).expand(B, Pq, P))
    J = torch.where(J_key.bool(), z_key.square() * (1 - A_key), -z_key.square() * A_key) * unmasked.unsqueeze(1)
    J_bar = z_n.square() * A_n * (1 - A_n) - others_n
    beta_rows = attn * (J - J_bar)
    alpha = torch.zeros(P, n_clusters * N, dtype=attn.dtype, device=attn.device)
    cols = (cluster[:, None, None] * N + torch.arange(N, device=attn.device)).expand(B, Pq, N)
    alpha.index_put_((query_pos.unsqueeze(-1).expand(B, Pq, N).reshape(-1), cols.reshape(-1)),
                     alpha_rows.reshape(-1), accumulate=True)
    beta = torch.zeros(P, P, dtype=attn.dtype, device=attn.device)
    beta.index_add_(0, query_pos.reshape(-1), beta_rows.reshape(-1, P))
    return alpha / B, beta / B


def cl_gradient_rows(rows: torch.Tensor, x_anchor: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Lemma J.2: the gradient on the query rows ``W = E Q`` ``[P, d]`` of a loss whose gradient with
    respect to the pooled anchors ``F(X^+_b)`` is ``g [B, d]`` (InfoNCE: ``g = -(F(X^{++}) - sum_X' w_X' F(X'))``):
    ``dW_p = sum_b sum_q a_{pq} (h_q - c_p) X^+_{b,q}``, ``h_q = <X^+_{b,q}, g_b> / P``, ``c_p = sum_r a_{pr} h_r``.

    Example:
        >>> W, x, g = torch.zeros(3, 4), torch.randn(2, 3, 4), torch.randn(2, 4)
        >>> cl_gradient_rows(W, x, g).shape
        torch.Size([3, 4])
    """
    P = x_anchor.shape[1]
    a = torch.softmax(torch.einsum("pd,bqd->bpq", rows, x_anchor), dim=-1)
    h = torch.einsum("bqd,bd->bq", x_anchor, g) / P
    c = torch.einsum("bpq,bq->bp", a, h)
    return torch.einsum("bpq,bqd->pd", a * (h.unsqueeze(1) - c.unsqueeze(-1)), x_anchor)


def eta_mae(P: int, K: int, C_s: int, gamma: float, Ez3: float = 1.0, first_step: float = 0.02) -> float:
    """Our MAE learning rate (the paper asks only ``eta << poly(P)``): the first step moves a local patch's own-area
    correlation by about ``first_step``. At init ``alpha_own ~ (gamma / K) E[z^3] (1 - gamma) C_s / P``, so
    ``eta = first_step K P / (gamma (1 - gamma) C_s E[z^3])`` (``0.02 K P^{1 - kappa_s} / (gamma (1 - gamma))``).

    Example:
        >>> round(eta_mae(256, 2, 16, 0.75), 2)     # eta ~ 3 at P = 256, K = 2
        3.41
    """
    return first_step * K * P / (gamma * (1.0 - gamma) * C_s * Ez3)


def cl_loss_floor(n_neg: int, K: int, tau: float) -> float:
    """``tau E[log(1 + n)]``, ``n ~ Binomial(n_neg, 1/K)`` same-cluster negatives: the in-batch InfoNCE loss
    of a representation that tells clusters apart perfectly and samples of one cluster not at all (the
    positive ties with the same-cluster negatives, the others get weight 0). The
    ``OPT = Theta(log(N_c / K))`` of Huang et al. 2025, Sec. 4; a reference level, not a strict bound (the views are
    masked, the negatives are not).

    Example:
        >>> round(cl_loss_floor(31, 8, 1.0), 3)
        1.503
    """
    p = 1.0 / K
    total = 0.0
    for n in range(n_neg + 1):
        log_pmf = _log_comb(n_neg, n) + (n * math.log(p) if n else 0.0) + (
            (n_neg - n) * math.log1p(-p) if p < 1 else (0.0 if n == n_neg else -math.inf))
        total += math.exp(log_pmf) * math.log1p(n)
    return tau * total


def attention_diversity(attn: torch.Tensor, coords: torch.Tensor, top_n: int = 10,
                        drop_keys: torch.Tensor | None = None) -> torch.Tensor:
    """The attention diversity of Huang et al. 2025, App. B, of attention maps ``attn [..., P, P]`` (queries x
    keys) on a grid with coordinates ``coords [P, 2]``: every query's ``top_n`` keys by descending weight,
    their coordinates concatenated into ``c_p`` (``2 top_n`` numbers), then the mean Euclidean distance
    ``1/P^2 sum_{p, p'} ||c_p - c_p'||`` over all query pairs: ``[...]``. 0 when every query attends to the
    same top-n keys in the same order (global attention); large when each query attends near itself.
    ``drop_keys [..., P]`` (e.g. masked keys) are left out of the top-n. The distance and the key order are our
    reading: the paper does not state them.

    Example:
        >>> coords = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
        >>> float(attention_diversity(torch.eye(4), coords, top_n=1))        # own patch: mean pair distance
        0.8535...
        >>> float(attention_diversity(torch.eye(4)[[0, 0, 0, 0]], coords, top_n=1))   # all on key 0
        0.0
    """
    if drop_keys is not None:
        attn = attn.masked_fill(drop_keys.unsqueeze(-2), float("-inf"))
    top = attn.topk(top_n, dim=-1).indices                                  # [..., P, n], descending weight
    c = coords.to(torch.float64, copy=False)[top].flatten(-2)               # [..., P, 2 n]
    return torch.cdist(c, c).mean((-2, -1))


def init_loss(P: int, C_1: int, C_s: int, n_local: int, n_masked: int, Ez2: float) -> dict[str, float]:
    """Expected MAE loss per masked patch at ``Q = 0`` (uniform attention, so ``A_m = |U cap P_m| / P``),
    exactly: Lemma D.8 with, given the query p masked, ``|U cap P_m|`` hypergeometric (the ``P - n_masked``
    unmasked positions among the other ``P - 1``; ``C_a - 1`` of them in p's own area). ``loss_local``,
    ``loss_global`` and ``loss`` (over all masked patches); the denominator of the ``loss_ratio_init``
    metric. The approximation ``1/2 E[z^2] (1 - (1 - gamma) C_a / P)^2`` leaves out the spread and the
    other areas.

    Example:
        >>> {k: round(v, 3) for k, v in init_loss(256, 128, 16, 8, 192, 1.0).items()}
        {'loss_local': 0.494, 'loss_global': 0.384, 'loss': 0.439}
    """
    draws, pop = P - n_masked, P - 1

    def moments(C):  # E[A], E[A^2] for an area with C of the other P - 1 positions
        mean = draws * C / pop
        var = draws * (C / pop) * (1 - C / pop) * (pop - draws) / max(pop - 1, 1)
        return mean / P, (var + mean ** 2) / P ** 2

    def per_patch(own_C, others):
        m1, m2 = moments(own_C - 1)
        return 0.5 * Ez2 * (1 - 2 * m1 + m2 + sum(moments(C)[1] for C in others))

    local = per_patch(C_s, [C_1] + [C_s] * (n_local - 1))
    glob = per_patch(C_1, [C_s] * n_local)
    return {"loss_local": local, "loss_global": glob, "loss": (C_1 * glob + n_local * C_s * local) / P}
