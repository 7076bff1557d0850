"""Closed forms of the universality / label-efficiency trade-off of contrastive learning (Shi 2024,
Ch. 7 and App. F; Shi et al. 2023).

The linear multi-task model: ``T`` tasks, shared features ``S`` (``s`` of them), private features ``P_t``
(``r - s`` per task), spurious features ``U`` (``u``), ``k = s + T (r - s)``, ``d = k + u``, inputs ``x = M z``
with an orthonormal dictionary ``M``. A representation is ``phi(x) = W x`` with ``W [k, d]`` in
``{||W||_2 <= 1, ||W||_F <= sqrt(r)}``. Everything here is a plain function of numbers or tensors; nothing
reads a DataModule or a LightningModule.

* :func:`layout`: the coordinates of each feature group.
* :func:`project_spectral_frobenius`: the exact Euclidean projection onto the representation class (one SVD,
  the Frobenius multiplier found on the singular values only); :func:`project_bisection`: the same projection with
  the multiplier found by plain bisection, the tests' reference;
  :func:`project_trust_region`: the exact projection onto that class intersected with the trust region
  ``||W - W*||_F <= gamma`` of contrastive regularisation (Dykstra's algorithm).
* :func:`column_norms`, :func:`group_means`: ``c_j = ||(W M)_{:, j}||^2`` and their means per group.
* :func:`predicted_column_norms`: the closed forms of Props 7.3 / 7.4 / F.9 (universal ``1, 1/T, 0``; specific
  ``1, 1`` on its task and ``0`` elsewhere; contrastive regularisation
  ``min(1, sqrt(1/T) + gamma / sqrt(r - s))^2`` on the target).
* :func:`closed_form_representation`: a ``W`` with those column norms (``Q = I`` in ``W* = [Q A*, 0] M^-1``).
* :func:`contrastive_loss_closed_form`: ``sum_t w_t E l(c_S sigma_S^2 Z + c_{P_t} sigma_R^2 Z_t)``,
  ``Z ~ chi^2_s``, ``Z_t ~ chi^2_{r-s}``, the population loss of a representation with that structure.
* :func:`private_overlap`: how much the target's private features share directions with the other tasks'.

How a representation serves a downstream task (the ridge and norm-constrained probes, linear CKA) is
:mod:`featlearn.theory.universality_downstream`.

Example:
    >>> g = layout(T=2, s=2, r=3, u=1)
    >>> g["k"], g["d"], g["P"][1].tolist(), g["U"].tolist()
    (4, 5, [3], [4])
    >>> predicted_column_norms("universal", T=4, s=5, r=10)["P0"]
    0.25
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from featlearn.errors import ConfigError

__all__ = ["layout", "project_spectral_frobenius", "project_bisection", "project_trust_region", "column_norms",
           "group_means", "predicted_column_norms", "closed_form_representation", "contrastive_loss_closed_form",
           "private_overlap", "MODES"]

MODES = ("universal", "specific", "cr")
"""Pretraining modes: all tasks, the target task only, contrastive regularisation of the universal
representation on the target task (Prop F.9)."""

def layout(T: int, s: int, r: int, u: int) -> dict:
    """Coordinates of the feature groups in ``z``: ``S``, ``P`` (a list, one per task), ``R`` (all invariant
    features), ``U``, and the sizes ``k``, ``d``.

    Example:
        >>> layout(T=3, s=1, r=2, u=2)["P"][2].tolist()
        [3]
    """
    p = r - s
    k = s + T * p
    ar = torch.arange
    return {"S": ar(s), "P": [s + t * p + ar(p) for t in range(T)], "R": ar(k), "U": k + ar(u), "k": k,
            "d": k + u, "T": T, "s": s, "r": r, "u": u}


# ------------------------------------------------------------------------------------------------
# the projection onto {||W||_2 <= spec, ||W||_F^2 <= radius2}
# ------------------------------------------------------------------------------------------------
def _shrink_multiplier(sigma: torch.Tensor, radius2: float, spec: float) -> torch.Tensor:
    """The smallest ``t = 1 + tau >= 1`` with ``sum_i min(spec, sigma_i / t)^2 <= radius2`` (exact).

    ``g(t) = sum_i min(spec, sigma_i / t)^2`` is continuous and decreasing; between two breakpoints
    ``t = sigma_i / spec`` it is ``c spec^2 + (sum of the uncapped sigma^2) / t^2`` with the ``c`` largest values
    capped. Sorting the singular values gives every piece at once; the root lies on the one piece whose
    capped set is consistent with its own ``t``. No SVD is repeated: only the ``min(k, d)`` values are searched.
    """
    s = torch.sort(sigma.double(), descending=True).values          # [..., n]: a batch of matrices at once
    n = s.shape[-1]
    inside = (s.clamp(max=spec) ** 2).sum(-1) <= radius2
    tail = torch.flip(torch.cumsum(torch.flip(s ** 2, (-1,)), -1), (-1,))  # tail[c] = sum_{i >= c} s_i^2
    c = torch.arange(n, device=s.device, dtype=torch.float64)
    room = radius2 - c * spec ** 2  # what the uncapped values may hold when the c largest are capped
    t = torch.sqrt(tail / room.clamp_min(1e-300))
    first = torch.full((*s.shape[:-1], 1), math.inf, dtype=s.dtype, device=s.device)
    upper = torch.cat([first, s[..., :-1] / spec], -1)  # s_{c-1}/spec
    valid = (room > 0) & (t >= s / spec) & (t <= upper * (1 + 1e-12)) & (t >= 1)
    # rounding at a breakpoint: fall back on the largest consistent candidate
    valid = torch.where(valid.any(-1, keepdim=True), valid, (room > 0) & (t >= 1))
    chosen = t.gather(-1, valid.to(torch.int8).argmax(-1, keepdim=True)).squeeze(-1)  # the first valid piece
    return torch.where(inside, torch.ones_like(chosen), chosen)


def project_spectral_frobenius(W: torch.Tensor, radius2: float, spec: float = 1.0,
                               frobenius: bool = True) -> torch.Tensor:
    """The Euclidean projection of ``W`` onto ``{||W||_2 <= spec, ||W||_F^2 <= radius2}`` (``frobenius=False``:
    onto the spectral ball only).

    ``W`` may be a batch ``[..., k, d]`` (several seeds' weights), projected each on its own. One SVD ``W = U
    diag(sigma) V^T``; the result is ``U diag(min(spec, sigma / (1 + tau))) V^T`` with the
    smallest ``tau >= 0`` meeting the Frobenius bound (the KKT form: both sets are unitarily invariant, so the
    projection acts on the singular values, which it clips and shrinks). Computed in float64, returned in
    ``W``'s dtype.

    Example:
        >>> P = project_spectral_frobenius(3 * torch.eye(4), radius2=2.0)
        >>> torch.linalg.matrix_norm(P, 2).item() <= 1 + 1e-12, round(float((P ** 2).sum()), 6)
        (True, 2.0)
    """
    if radius2 <= 0 or spec <= 0:
        raise ConfigError("radius2" if radius2 <= 0 else "spec", "> 0", radius2 if radius2 <= 0 else spec)
    w = W.double()
    U, sigma, Vh = torch.linalg.svd(w, full_matrices=False)
    t = _shrink_multiplier(sigma, radius2, spec) if frobenius else torch.ones(sigma.shape[:-1], dtype=torch.float64, device=sigma.device)
    p = (sigma / t.unsqueeze(-1)).clamp(max=spec)
    return ((U * p.unsqueeze(-2)) @ Vh).to(W.dtype)


def project_bisection(W: torch.Tensor, radius2: float, spec: float = 1.0, iters: int = 200) -> torch.Tensor:
    """The same projection with the Frobenius multiplier found by plain bisection (float64):
    an independent reference of :func:`project_spectral_frobenius`'s exact search, for the tests.

    Example:
        >>> A = torch.randn(3, 4, dtype=torch.float64) * 3
        >>> bool(torch.allclose(project_bisection(A, 2.0), project_spectral_frobenius(A, 2.0), atol=1e-10))
        True
    """
    U, sigma, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    shrink = lambda tau: (sigma / (1 + tau)).clamp(max=spec)  # noqa: E731
    tau = 0.0
    if float((shrink(0.0) ** 2).sum()) > radius2:
        lo, hi = 0.0, float(((sigma ** 2).sum() / radius2).sqrt())  # at tau = hi the bound holds
        for _ in range(iters):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float((shrink(mid) ** 2).sum()) > radius2 else (lo, mid)
        tau = hi
    return ((U * shrink(tau)) @ Vh).to(W.dtype)


def project_trust_region(W: torch.Tensor, reference: torch.Tensor, gamma: float, spec: float = 1.0,
                         radius2: float | None = None, tol: float = 1e-10, max_iter: int = 500) -> torch.Tensor:
    """The Euclidean projection of ``W`` onto ``{||W||_2 <= spec [, ||W||_F^2 <= radius2]} n {||W - reference||_F
    <= gamma}``: the feasible set of contrastive regularisation (Prop F.9), by Dykstra's algorithm.

    Projecting onto one set and then the other (alternating) gives a feasible point but not the nearest one, so
    projected gradient descent with it can stop short of the constrained optimum. Dykstra's correction terms make
    the iterates converge to the exact projection; each iteration costs one SVD (the class's own exact projection,
    :func:`project_spectral_frobenius`) and one ball scaling. ``reference`` must lie in the class (it does: it is
    a trained or closed-form universal ``W*``), so the intersection is never empty. Stops when an iteration moves
    the point by less than ``tol`` (relative, Frobenius); float64 inside, returned in ``W``'s dtype.

    Example:
        >>> ref = torch.zeros(2, 2, dtype=torch.float64)
        >>> P = project_trust_region(torch.diag(torch.tensor([3.0, 0.0])), ref, gamma=0.5)
        >>> [round(v, 6) for v in torch.diag(P).tolist()]                  # the ball binds, not the spectral cap
        [0.5, 0.0]
    """
    if not gamma > 0:
        raise ConfigError("gamma", "> 0", gamma)
    ref = reference.double()
    frob = radius2 is not None

    def onto_class(a):
        return project_spectral_frobenius(a, radius2 if frob else 1.0, spec, frobenius=frob)

    def onto_ball(a):
        dist = float(torch.linalg.matrix_norm(a - ref))
        return a if dist <= gamma else ref + (a - ref) * (gamma / dist)

    x = W.double()
    p = torch.zeros_like(x)
    q = torch.zeros_like(x)
    for _ in range(max_iter):
        y = onto_class(x + p)
        p = x + p - y
        x_new = onto_ball(y + q)
        q = y + q - x_new
        moved = float(torch.linalg.matrix_norm(x_new - x))
        x = x_new
        if moved <= tol * max(1.0, float(torch.linalg.matrix_norm(x))):
            break
    # the last step is the ball's: finish on the class so the spectral bound holds to rounding, not to tol
    return onto_class(x).to(W.dtype)


# ------------------------------------------------------------------------------------------------
# column norms and their closed forms
# ------------------------------------------------------------------------------------------------
def column_norms(W: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``c_j = ||(W M)_{:, j}||^2`` for every latent coordinate ``j`` (``[d]``, float64): how strongly the
    representation encodes feature ``j``.

    Example:
        >>> column_norms(torch.eye(2, 3) * 2, torch.eye(3)).tolist()
        [4.0, 4.0, 0.0]
    """
    return ((W.double() @ M.double()) ** 2).sum(0)


def group_means(c: torch.Tensor, groups: dict) -> dict[str, float]:
    """Means of ``c`` over ``S``, each ``P_t`` (as ``P0``, ``P1``, ...) and ``U`` (``groups`` from :func:`layout`).

    Example:
        >>> group_means(torch.tensor([1.0, 0.5, 0.0, 0.0]), layout(T=2, s=1, r=2, u=1))
        {'S': 1.0, 'P0': 0.5, 'P1': 0.0, 'U': 0.0}
    """
    out = {"S": float(c[groups["S"]].mean())}
    out.update({f"P{t}": float(c[idx].mean()) for t, idx in enumerate(groups["P"])})
    out["U"] = float(c[groups["U"]].mean()) if groups["U"].numel() else 0.0
    return out


def predicted_column_norms(mode: str, T: int, s: int, r: int, gamma: float | None = None,
                           target: int = 0, start: float | None = None) -> dict[str, float]:
    """The theory's squared column norms per group for the even mixture and ``sigma = 1``.

    * ``universal`` (Prop 7.3 with the logistic loss, which fills ``S`` first because a shared coordinate
      serves every task): ``c_S = 1``, ``c_{P_t} = min(1, (r - s) / (T (r - s))) = min(1, 1/T)``, ``c_U = 0``;
    * ``specific`` (Prop 7.4, pretrained on task ``target`` only): 1 on ``S`` and ``P_target``, 0 elsewhere;
    * ``cr`` (Prop F.9: the universal representation moved within ``||W - W*||_F <= gamma`` on the target task,
      no Frobenius cap): ``sqrt(c_{P_target}) = min(1, sqrt(start) + gamma / sqrt(r - s))`` with ``start`` the
      universal value (default ``1/T``); every other group keeps its universal value. The dissertation writes
      ``gamma / sqrt(s)``: the same thing in its example ``r = 2 s``; moving ``r - s`` columns each by
      ``delta`` costs ``delta sqrt(r - s)`` of the radius, hence ``sqrt(r - s)`` in general.

    Example:
        >>> p = predicted_column_norms("cr", T=4, s=5, r=10, gamma=1.0)
        >>> round(p["P0"], 4), p["P1"]
        (0.8972, 0.25)
    """
    if mode not in MODES:
        raise ConfigError("mode", f"one of {MODES}", mode)
    universal = min(1.0, 1.0 / T)
    if mode == "specific":
        return {"S": 1.0, **{f"P{t}": float(t == target) for t in range(T)}, "U": 0.0}
    out = {"S": 1.0, **{f"P{t}": universal for t in range(T)}, "U": 0.0}
    if mode == "cr":
        if gamma is None or gamma <= 0:
            raise ConfigError("gamma", "> 0 for contrastive regularisation", gamma)
        base = universal if start is None else start
        out[f"P{target}"] = min(1.0, math.sqrt(base) + gamma / math.sqrt(r - s)) ** 2
    return out


def closed_form_representation(groups: dict, M: torch.Tensor, norms: dict[str, float]) -> torch.Tensor:
    """``W = [diag(sqrt(c_R)), 0] M^T`` (``[k, d]``, float64): the optimum ``W* = [Q A*, 0] M^-1`` with
    ``Q = I`` for the column norms ``norms`` (keys as :func:`group_means`; ``U`` must be 0).

    Example:
        >>> g = layout(T=2, s=1, r=2, u=1)
        >>> W = closed_form_representation(g, torch.eye(4), predicted_column_norms("universal", 2, 1, 2))
        >>> [round(c, 6) for c in column_norms(W, torch.eye(4)).tolist()]
        [1.0, 0.5, 0.5, 0.0]
    """
    k = groups["k"]
    a = torch.zeros(k, dtype=torch.float64, device=M.device)
    a[groups["S"]] = math.sqrt(norms["S"])
    for t, idx in enumerate(groups["P"]):
        a[idx] = math.sqrt(norms[f"P{t}"])
    return torch.diag(a) @ M.double()[:, :k].t()


def private_overlap(W: torch.Tensor, M: torch.Tensor, groups: dict, target: int = 0) -> float:
    """How much the target task's private features share representation directions with the other tasks':
    the cosine of the smallest principal angle between the spans of ``(W M)_{:, P_target}`` and
    ``(W M)_{:, P_t}``, ``t != target`` (0: orthogonal, as in the closed form ``W*``; 1: a shared direction).

    The universal loss never sees two tasks' private features in one sample, so it leaves their relative
    orientation free; with ``||W||_2 <= 1``, a target column that grows along a shared direction must take
    weight from the other task (contrastive regularisation's "the rest is kept" assumes 0 here). Columns below
    1e-6 of the largest do not span anything.

    Example:
        >>> g = layout(T=2, s=1, r=2, u=0)
        >>> W = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.6, 0.6], [0.0, 0.0, 0.0]])
        >>> round(private_overlap(W, torch.eye(3), g), 6), private_overlap(torch.eye(3), torch.eye(3), g)
        (1.0, 0.0)
    """
    A = W.double() @ M.double()

    def basis(cols):
        u, sig, _ = torch.linalg.svd(A[:, cols], full_matrices=False)
        return u[:, sig > max(float(sig.max()), 1e-300) * 1e-6] if sig.numel() and float(sig.max()) > 0 else u[:, :0]

    others = torch.cat([idx for t, idx in enumerate(groups["P"]) if t != target])
    q_t, q_o = basis(groups["P"][target]), basis(others)
    if q_t.shape[1] == 0 or q_o.shape[1] == 0:
        return 0.0
    return float(torch.linalg.matrix_norm(q_t.t() @ q_o, 2))


def contrastive_loss_closed_form(c_S: float, c_P: Sequence[float], s: int, r: int, weights: Sequence[float] | None = None,
                                 sigma_S: float = 1.0, sigma_R: float = 1.0, loss: str = "theory",
                                 samples: int = 400_000, seed: int = 0) -> float:
    """The population contrastive loss of a representation ``W = [diag(sqrt(c)), 0] M^T`` (column norms
    ``c_S`` on ``S``, ``c_P[t]`` on ``P_t``, 0 on ``U``) with ``E phi(x^-) = 0``:
    ``sum_t w_t E l(c_S sigma_S^2 Z + c_{P_t} sigma_R^2 Z_t)``, ``Z ~ chi^2_s``, ``Z_t ~ chi^2_{r-s}``.

    ``loss="theory"``: ``l(t) = log(1 + e^-t)``, by Monte Carlo (fixed seed, float64; standard error below 1e-4
    at the default size); ``"pca"``: ``l(t) = -t``, exactly ``-(c_S sigma_S^2 s + sum_t w_t c_{P_t}
    sigma_R^2 (r - s))``. Other losses have no closed form of this kind (ValueError).

    Example:
        >>> contrastive_loss_closed_form(1.0, [0.5, 0.5], s=2, r=4, loss="pca")
        -3.0
        >>> round(contrastive_loss_closed_form(0.0, [0.0], s=2, r=4), 4)    # l(0) = log 2
        0.6931
    """
    T = len(c_P)
    w = [1.0 / T] * T if weights is None else [float(v) / sum(weights) for v in weights]
    p = r - s
    if loss == "pca":
        return -(c_S * sigma_S ** 2 * s + sum(wt * ct * sigma_R ** 2 * p for wt, ct in zip(w, c_P)))
    if loss != "theory":
        raise ValueError(f"no closed form for loss {loss!r} (only 'theory' and 'pca')")
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for wt, ct in zip(w, c_P):
        z = (torch.randn(samples, s, generator=g, dtype=torch.float64) ** 2).sum(1)
        zt = (torch.randn(samples, p, generator=g, dtype=torch.float64) ** 2).sum(1)
        total += wt * float(torch.nn.functional.softplus(-(c_S * sigma_S ** 2 * z + ct * sigma_R ** 2 * zt)).mean())
    return total
