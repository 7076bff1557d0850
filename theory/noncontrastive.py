"""Closed-form population theory of non-contrastive learning with a prediction head (Wen & Li 2022).

Everything here is a function of the weights ``W [..., m, d]``, the head ``E [..., m, m]`` and the data
constants (features, alphas, probs, P, P0, noise std); nothing reads a DataModule or a LightningModule.

* :func:`hypergeometric_moments`: the constants C0, C1, C2 of App. A and the optimum OPT of
  Cor. E.3.
* :func:`split_weights`: B = W V^T and the noise parts U = W - B V, the one place they are computed.
* :func:`population_loss` (through :func:`population_terms`): the exact N = infinity loss (App. A.1) in
  closed form for Gaussian noise; autograd on it gives the population gradient.
* :func:`representation_correlation`, :func:`substitution_ratio`: the theory's diagnostics (Cor. 4.2 / 4.4,
  Lemma 5.2).
* :func:`feature_outcome` (DIV / COL / PAR), :class:`PhaseTracker` (the four phases of Sec. 5).
* :func:`simulate_population`: batched population gradient descent (Algorithm 1 with N = infinity) on the
  moments the loss reads (:func:`moment_loss`), the simulator of the headline table; ``NonContrastiveModule(gradient="population")`` runs the same steps.

Example:
    >>> w = torch.eye(2, 6, dtype=torch.float64)                       # w_j = v_j: the optimum
    >>> round(float(population_loss(w, torch.eye(2, dtype=torch.float64), torch.eye(2, 6, dtype=torch.float64),
    ...                             [4.0, 2.7], [0.5, 0.5], 32, 8, 1.0)), 5)
    0.35294
"""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from featlearn.errors import ConfigError

HEADS = ("offdiag", "none", "full")


def hypergeometric_moments(num_patches: int, num_feature_patches: int) -> dict[str, float]:
    """Constants of Wen & Li 2022, App. A, for a = |S cap view1| ~ Hypergeometric(P, P0, P/2).

    Returns ``E_a, V_a, C0 = E[a (P0 - a)], C1 = E[a^2], C2 = (P - P0) / 2`` (per-view noise patches;
    the C's here are *not* divided by the number of features) and ``OPT = 2 - 2 C0 / C1``.

    Example:
        >>> round(hypergeometric_moments(32, 8)["OPT"], 5)
        0.35294
    """
    P, P0 = num_patches, num_feature_patches
    ea = P0 / 2
    va = P0 * (P - P0) / (4 * (P - 1)) if P > 1 else 0.0
    c1 = ea * ea + va
    c0 = P0 * ea - c1
    return {"E_a": ea, "V_a": va, "C0": c0, "C1": c1, "C2": (P - P0) / 2, "OPT": 2 - 2 * c0 / c1}


def split_weights(w: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``B = W V^T`` (``[..., m, K]``, weight on each feature) and the noise parts ``U = W - B V``.

    Example:
        >>> b, u = split_weights(torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 0.0]]))
        >>> b.tolist(), u.tolist()
        ([[3.0]], [[0.0, 4.0]])
    """
    b = w @ features.T
    return b, w - b @ features


def _noise_gram(u: torch.Tensor, noise_std: float) -> torch.Tensor:
    """a = s^2 U U^T: covariance of <w_j, xi> over a noise patch."""
    return noise_std ** 2 * (u @ u.transpose(-1, -2))


def _moments_M(a: torch.Tensor) -> torch.Tensor:
    """M_rq = E[x_r^3 x_q^3] for x ~ N(0, a) (Isserlis): 9 a_rr a_qq a_rq + 6 a_rq^3."""
    d = torch.diagonal(a, dim1=-2, dim2=-1)
    return 9 * d[..., :, None] * d[..., None, :] * a + 6 * a ** 3


def _feature_weights(alphas, probs, like: torch.Tensor) -> torch.Tensor:
    """pi_l alpha_l^6, the weight of feature l in every cubic moment."""
    return torch.tensor(alphas, dtype=like.dtype, device=like.device) ** 6 * torch.tensor(
        probs, dtype=like.dtype, device=like.device)


def population_terms(w: torch.Tensor, head: torch.Tensor, features: torch.Tensor, alphas, probs,
                     num_patches: int, num_feature_patches: int, noise_std: float,
                     w_target: torch.Tensor | None = None, stop_grad: bool = True) -> dict:
    """Closed-form population moments (Wen & Li 2022, App. A.1, for Gaussian noise, with C2' = (P - P0)/2).

    ``w [..., m, d]``, ``head [..., m, m]``, ``features [K, d]``. Returns ``EFG, U = E F^2, EG2`` (each
    ``[..., m]``), and ``B [..., m, K]``, ``a [..., m, m]`` (noise Gram of the online weights).
    """
    c = hypergeometric_moments(num_patches, num_feature_patches)
    feats = features.to(w)
    coef = _feature_weights(alphas, probs, w)
    wt = w if w_target is None else w_target
    if stop_grad:
        wt = wt.detach()

    def gram(v):
        b, u = split_weights(v, feats)
        return b, _noise_gram(u, noise_std)

    b, a = gram(w)
    if w_target is None:  # the target is the online branch itself: its moments, detached for stop-grad
        bt, at = (b.detach(), a.detach()) if stop_grad else (b, a)
    else:
        bt, at = gram(wt)
    return {**_moment_terms(b, a, bt, at, head, coef, c), "B": b, "a": a}


def _moment_terms(b, a, bt, at, head, coef, c) -> dict:
    """E[F G], E F^2, E G^2 from the feature weights and noise Grams of the online (b, a) and target
    (bt, at) weights: the loss reads the weights through these alone."""
    eb3 = head @ b ** 3                                                  # (E B^3)_{j l}
    efg = c["C0"] * (coef * eb3 * bt ** 3).sum(-1)
    m_on = _moments_M(a)
    u = c["C1"] * (coef * eb3 ** 2).sum(-1) + c["C2"] * torch.diagonal(head @ m_on @ head.transpose(-1, -2),
                                                                       dim1=-2, dim2=-1)
    eg2 = c["C1"] * (coef * bt ** 6).sum(-1) + c["C2"] * 15 * torch.diagonal(at, dim1=-2, dim2=-1) ** 3
    return {"EFG": efg, "U": u, "EG2": eg2}


def population_loss(w, head, features, alphas, probs, num_patches, num_feature_patches, noise_std,
                    w_target=None, stop_grad: bool = True) -> torch.Tensor:
    """Population loss ``2 - (2/m) sum_j E[F_j G_j] / sqrt(E F_j^2 sg(E G_j^2))`` (Wen & Li 2022, eq. A.1),
    batched over leading dims of ``w [..., m, d]``; autograd gives the exact population gradient."""
    t = population_terms(w, head, features, alphas, probs, num_patches, num_feature_patches, noise_std,
                         w_target, stop_grad)
    eg2 = t["EG2"].detach() if stop_grad else t["EG2"]
    return 2 - 2 * (t["EFG"] / torch.sqrt(t["U"] * eg2)).mean(-1)


def moment_loss(b: torch.Tensor, gram: torch.Tensor, head: torch.Tensor, alphas, probs, num_patches: int,
                num_feature_patches: int, noise_std: float) -> torch.Tensor:
    """:func:`population_loss` of the shared stop-grad target from ``B = W V^T [..., m, K]`` and the noise
    parts' Gram ``U U^T [..., m, m]``, which is all it reads of ``W`` (orthonormal features).

    Example:
        >>> w, v, e = torch.randn(2, 6).double(), torch.eye(2, 6).double(), torch.eye(2).double()
        >>> b, u = split_weights(w, v); args = ([4.0, 2.7], [0.5, 0.5], 32, 8, 1.0)
        >>> bool(torch.isclose(moment_loss(b, u @ u.T, e, *args), population_loss(w, e, v, *args)))
        True
    """
    c = hypergeometric_moments(num_patches, num_feature_patches)
    a = noise_std ** 2 * gram
    t = _moment_terms(b, a, b.detach(), a.detach(), head, _feature_weights(alphas, probs, b), c)
    return 2 - 2 * (t["EFG"] / torch.sqrt(t["U"] * t["EG2"].detach())).mean(-1)


def representation_correlation(w: torch.Tensor, features: torch.Tensor, alphas, probs, num_patches: int,
                               num_feature_patches: int, noise_std: float) -> torch.Tensor:
    """Corr(f_i(X), f_j(X)) over un-augmented X (all P patches; Wen & Li 2022, Cor. 4.2 / 4.4), in
    closed form:
    Cov = P0^2 sum_l pi_l alpha_l^6 B_il^3 B_jl^3 + (P - P0) M_ij. Returns ``[..., m, m]``."""
    b, u = split_weights(w, features.to(w))
    b3 = b ** 3
    cov = num_feature_patches ** 2 * (b3 * _feature_weights(alphas, probs, w)) @ b3.transpose(-1, -2) \
        + (num_patches - num_feature_patches) * _moments_M(_noise_gram(u, noise_std))
    sd = torch.sqrt(torch.diagonal(cov, dim1=-2, dim2=-1))
    return cov / (sd[..., :, None] * sd[..., None, :])


def substitution_ratio(b, r, head, alpha1: float, num_patches: int, num_feature_patches: int,
                       noise_std: float, lead: int) -> float:
    """Population version of Lemma 5.2's ratio on v1-samples, rms(E_lag,lead f_lead) / rms(f_lag) over
    view 1, from ``B [m, K]``, ``R = ||U_j||^2 [m]`` and ``E [m, m]`` (host tensors: read entry by entry).
    On a v1-sample E f_j^2 = C1 alpha1^6 B_j1^6 + C2 M_jj with M_jj = 15 a_jj^3, a_jj = s^2 R_j."""
    c = hypergeometric_moments(num_patches, num_feature_patches)
    ms = [c["C1"] * alpha1 ** 6 * float(b[j, 0]) ** 6 + c["C2"] * 15 * (float(r[j]) * noise_std ** 2) ** 3
          for j in range(2)]
    return abs(float(head[1 - lead, lead])) * math.sqrt(ms[lead] / ms[1 - lead])


def feature_outcome(cos: torch.Tensor, threshold: float = 0.5) -> tuple[str, list[int]]:
    """Which feature each neuron ends on (``argmax_l |cos_jl|`` if it is >= threshold, else -1) and the
    run's class: ``DIV`` (the neurons cover features 0 and 1), ``COL`` (all learned, one feature) or
    ``PAR`` (some neuron still unlearned, or any other pattern).

    Example:
        >>> feature_outcome(torch.tensor([[0.9, 0.1], [0.05, -0.8]]))
        ('DIV', [0, 1])
    """
    cos = cos.detach().abs().cpu()
    best = cos.max(1)
    learned = [int(i) if float(v) >= threshold else -1 for v, i in zip(best.values, best.indices)]
    covered = set(learned) - {-1}
    if {0, 1} <= covered:
        return "DIV", learned
    if -1 not in learned and len(covered) == 1:
        return "COL", learned
    return "PAR", learned


OUTCOME_CODES = {"DIV": 0, "COL": 1, "PAR": 2}
"""Numeric outcome for scalar logs (TensorBoard's HPARAMS tab)."""


class PhaseTracker:
    """Boundaries of the four phases of Wen & Li 2022, Sec. 5 (Lemmas 5.1-5.3, Prop. 5.4) for m = 2 (lead = the lucky
    neuron at t = 0).

    * T1: first t with |cos(w_lead, v1)| >= ``t1_cos`` (0.5, our choice; App. B: B11 >= 0.01).
    * T2 (end of substitution): first t >= T1 with substitution ratio >= log d, i.e. on v1-samples
      rms(E_lag,lead f_lead) >= log(d) rms(f_lag) (Lemma 5.2's "|E21 f1| >> |f2|" with the paper's log d
      margin) [proposal: the paper's R_lag < |E_lag,lead| / log d (with the E21 typo fixed) is also
      recorded as ``T2_paper``; at demo-A R2 stays ~0.39 at the E21 peak and it never fires].
    * T3 (end of acceleration): first t > T2 with |B_lag,2| >= 1/2 min(|B_lead,1|, sqrt(eta/eta_E) |E_lag,lead|).
    * T4 (end phase reached): first t > T3 with ||offdiag E||_F <= ``fall`` * its running peak.

    ``phase(t)``: 1 before T1, 2 in [T1, T2), 3 in [T2, T3), 4 from T3 on. ``update`` reads single entries
    of its tensors: pass host tensors.
    """

    def __init__(self, lead: int, dim: int, lr_ratio: float = 1.0, t1_cos: float = 0.5, fall: float = 0.1):
        self.lead, self.lag = lead, 1 - lead
        self.log_d, self.lr_ratio, self.t1_cos, self.fall = math.log(dim), lr_ratio, t1_cos, fall
        self.bounds: dict[str, int | None] = {"T1": None, "T2": None, "T2_paper": None, "T3": None, "T4": None}
        self.peak = 0.0

    def update(self, step: int, cos: torch.Tensor, b: torch.Tensor, r: torch.Tensor, head: torch.Tensor,
               subst_ratio: float) -> int:
        lead, lag, t = self.lead, self.lag, self.bounds
        e21 = abs(float(head[lag, lead]))
        off = float((head - torch.diag(torch.diagonal(head))).norm())
        self.peak = max(self.peak, off)
        if t["T1"] is None and abs(float(cos[lead, 0])) >= self.t1_cos:
            t["T1"] = step
        if t["T1"] is not None:
            if t["T2_paper"] is None and float(r[lag]) < e21 / self.log_d:
                t["T2_paper"] = step
            if t["T2"] is None and subst_ratio >= self.log_d:
                t["T2"] = step
        if t["T2"] is not None and t["T3"] is None and step > t["T2"]:
            if abs(float(b[lag, 1])) >= 0.5 * min(abs(float(b[lead, 0])), math.sqrt(self.lr_ratio) * e21):
                t["T3"] = step
        if t["T3"] is not None and t["T4"] is None and step > t["T3"] and off <= self.fall * self.peak:
            t["T4"] = step
        return self.phase(step)

    def phase(self, step: int) -> int:
        t = self.bounds
        if t["T1"] is None or step < t["T1"]:
            return 1
        if t["T2"] is None or step < t["T2"]:
            return 2
        if t["T3"] is None or step < t["T3"]:
            return 3
        return 4


def _population_chunk_fn(alphas, probs, num_patches, num_feature_patches, noise_std, lr, chunk):
    """``chunk`` population-GD steps on b = B [S, m, K], g = U U^T, q (U_t = q U_0) and e = E (each [S, m, m]);
    ``head_step`` = eta_E * mask; ``peak``: max |E| over every step (E21 can rise and fall between records).
    The loss reads W through B = W V^T and G alone, so dL/dW = (dL/dB) V + (dL/dG + dL/dG^T) U: a GD step on W
    is B -= eta dL/dB, U <- (I - eta (dL/dG + dL/dG^T)) U, in O(m^2 K) instead of O(m d) per run."""
    from torch.func import grad_and_value

    def total(b, g, e):  # runs are independent: grad of the sum = per-run grads
        return moment_loss(b, g, e, alphas, probs, num_patches, num_feature_patches, noise_std).sum()

    gv = grad_and_value(total, argnums=(0, 1, 2))

    def run(b, g, q, e, head_step, peak):
        eye = torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
        for _ in range(chunk):
            (gb, gg, ge), _ = gv(b, g, e)
            shrink = eye - lr * (gg + gg.transpose(-1, -2))
            b = b - lr * gb
            g = shrink @ g @ shrink.transpose(-1, -2)
            q = shrink @ q
            e = e - head_step * ge
            peak = torch.maximum(peak, e.abs())
        return b, g, q, e, peak

    return run


def simulate_population(w0: torch.Tensor, features: torch.Tensor, alphas, probs, num_patches: int,
                        num_feature_patches: int, noise_std: float, steps: int, lr: float = 0.05,
                        head_lr: float | None = None, head="offdiag", record_every: int = 100,
                        compile: bool = False, chunk: int = 10, progress: bool = False) -> dict:
    """Population gradient descent (the gradient of :func:`population_loss`) on a batch of independent runs
    ``w0 [S, m, d]`` at once (Algorithm 1 with N = infinity: W and E updated from the same point, diag(E) fixed at 1).
    The steps run on the moments B = W V^T and U U^T that the loss reads (:func:`_population_chunk_fn`), so a
    step costs the same at every d; the final ``w`` is rebuilt from them and W0's noise parts.

    ``head`` is one of ``HEADS`` or a list with one entry per run (e.g. with and without head in one
    batch). ``compile=True`` runs ``chunk`` steps per ``torch.compile``d call (~80-100 us a step for 64 runs
    on one CPU thread, ~35x the eager steps, after a one-off compile of ~5 s); ``record_every`` must then
    be a multiple of ``chunk``. ``progress``: a progress bar over the steps.

    Returns ``steps [T]``, ``cos [T, S, m, K]``, ``B [T, S, m, K]``, ``R [T, S, m]``, ``E [T, S, m, m]``,
    ``loss [T, S]`` recorded every ``record_every`` steps (and at the end), the final ``w``, ``head``, and
    ``E_peak [S, m, m]``, max |E| over every step (not only the recorded ones).

    Example:
        >>> w0 = torch.randn(3, 2, 10, dtype=torch.float64) / 10 ** 0.5
        >>> out = simulate_population(w0, torch.eye(2, 10, dtype=torch.float64), [4.0, 2.7], [0.5, 0.5],
        ...                           32, 8, 1.0, steps=20, record_every=10)
        >>> out["E"].shape
        torch.Size([3, 3, 2, 2])
    """
    s, m, _ = w0.shape
    heads = [head] * s if isinstance(head, str) else list(head)
    if len(heads) != s or any(h not in HEADS for h in heads):
        raise ConfigError("head", f"one of {HEADS} or a list of them, one per run", head)
    if compile and record_every % chunk:
        raise ConfigError("record_every", f"a multiple of chunk={chunk} when compiling", record_every)
    feats, head_lr = features.to(w0), lr if head_lr is None else head_lr
    eye = torch.eye(m, dtype=w0.dtype, device=w0.device)
    gram_error = (feats @ feats.T - torch.eye(len(feats), dtype=w0.dtype, device=w0.device)).abs().max()
    if not gram_error <= 1e3 * torch.finfo(w0.dtype).eps:
        raise ConfigError("features", "orthonormal rows (the moments B = W V^T and U U^T describe W)", "other rows")
    masks = {"offdiag": 1 - eye, "full": torch.ones_like(eye), "none": torch.zeros_like(eye)}
    head_step = torch.stack([head_lr * masks[h] for h in heads])
    b, u0 = split_weights(w0, feats)
    g = u0 @ u0.transpose(-1, -2)
    q = eye.expand(s, m, m).clone()
    e = eye.expand(s, m, m).clone()
    peak = e.abs()
    k = chunk if compile else 1
    constants = (list(alphas), list(probs), num_patches, num_feature_patches, float(noise_std), float(lr))
    run = _population_chunk_fn(*constants, k)
    if compile:
        run = torch.compile(run, dynamic=False)
    rec = {key: [] for key in ("steps", "cos", "B", "R", "E", "loss")}

    def record(t):
        with torch.no_grad():
            r = torch.diagonal(g, dim1=-2, dim2=-1).clone()
            rec["steps"].append(t)
            rec["B"].append(b.clone())
            rec["cos"].append(b / torch.sqrt((b * b).sum(-1) + r)[..., None])
            rec["R"].append(r)
            rec["E"].append(e.clone())
            rec["loss"].append(moment_loss(b, g, e, alphas, probs, num_patches, num_feature_patches, noise_std))

    t = 0
    record(0)
    with tqdm(total=steps, desc=f"population GD, {s} runs", unit="step", disable=not progress) as bar:
        while t < steps:
            if t + k > steps:  # tail shorter than a chunk: eager single steps
                run, k = _population_chunk_fn(*constants, 1), 1
            b, g, q, e, peak = run(b, g, q, e, head_step, peak)
            t += k
            if t % record_every == 0 or t == steps:
                record(t)
                bar.update(t - bar.n)
    out = {key: torch.stack(v) if key != "steps" else torch.tensor(v) for key, v in rec.items()}
    w = b @ feats + q @ u0
    out["w"], out["head"], out["E_peak"] = w, e, peak
    return out
