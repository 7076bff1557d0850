"""Fourier circuits for k-input modular addition (Li, Liang, Shi, Song, Zhou 2024, arXiv:2402.09469; Shi's
dissertation, Ch. 4): the closed-form maximum margin and the spectral quantities its theorems predict.

The network ``f(theta, a) = sum_i (sum_j u_{i,j}[a_j])^k w_i`` (Eq. 4.2) is (k+1)-homogeneous in
``theta_i = (u_{i,1}, ..., u_{i,k}, w_i)``. Its margin on a tuple is the correct logit minus the largest wrong
one; the normalised margin divides the smallest margin over all ``p^k`` tuples by ``||theta||_{2,k+1}^{k+1}``
with ``||theta||_{2,k+1} = (sum_i ||theta_i||_2^{k+1})^{1/(k+1)}`` (Def. 4.1, 4.4). Lemma 4.10 gives its maximum
over the network class, :func:`gamma_star`; Theorem 4.9 says that a network of width ``m >= 2^{2k-1}(p-1)/2``
attaining it has every neuron on one frequency ``zeta``: ``u_{i,j}[a] = beta cos(theta_{u_j} + 2 pi zeta a / p)``,
``w_i[c] = beta cos(theta_w + 2 pi zeta c / p)`` with ``theta_{u_1} + ... + theta_{u_k} = theta_w``, and every
frequency used. :func:`max_margin_network` builds that network (Lemma 4.11's construction).

Grokking's progress measures (Nanda et al. 2023, 2-input), for k inputs: a network's logit for class ``c``
depends on the tuple through its residue ``s = a_1 + ... + a_k mod p`` alone in a Fourier circuit. Averaging the
logits over the ``p^(k-1)`` tuples of each residue gives a ``p x p`` table whose Fourier modes over ``s`` at the
key frequencies are the circuit: :func:`key_frequency_part`. The restricted loss keeps only that part (and each
class's mean); the excluded loss removes it from every tuple's logits (:func:`ablation_losses`).

Example:
    >>> f"{gamma_star(3, 97):.3g}", f"{gamma_star(4, 47):.3g}"
    ('2.01e-05', '1.02e-05')
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F


def gamma_star(k: int, p: int) -> float:
    """The maximum normalised margin ``2 k! / ((2k+2)^{(k+1)/2} (p-1) p^{(k-1)/2})`` (Lemma 4.10)."""
    return 2 * math.factorial(k) / ((2 * k + 2) ** ((k + 1) / 2) * (p - 1) * p ** ((k - 1) / 2))


def norm_2_kplus1(U: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``||theta||_{2,k+1}`` of embeddings ``U`` ``[k, p, m]`` and output weights ``W`` ``[m, p]`` (Def. 4.1).

    Example:
        >>> float(norm_2_kplus1(torch.ones(2, 3, 1), torch.ones(1, 3)) ** 3)  # one neuron, ||theta_1||^2 = 9
        27.0
    """
    k = U.shape[0]
    per_neuron = (U.square().sum((0, 1)) + W.square().sum(1)).sqrt()
    return per_neuron.pow(k + 1).sum().pow(1.0 / (k + 1))


def margins(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each row's correct logit minus its largest wrong one ``[N]``.

    Example:
        >>> margins(torch.tensor([[3.0, 1.0, 2.0]]), torch.tensor([0])).tolist()
        [1.0]
    """
    correct = logits.gather(1, y.unsqueeze(1)).squeeze(1)
    wrong = logits.scatter(1, y.unsqueeze(1), float("-inf")).amax(1)
    return correct - wrong


def spectrum(vectors: torch.Tensor) -> dict[str, torch.Tensor]:
    """One-sided spectrum of vectors over their last axis (length ``p``, odd): per vector the dominant
    frequency ``zeta`` in ``1 .. (p-1)/2`` (the constant term excluded), its share of the total power (the
    constant term included: a pure cosine scores 1, an offset lowers it) and its phase ``theta`` in
    ``(-pi, pi]``, so that ``v[a] = beta cos(theta + 2 pi zeta a / p)`` for a pure cosine.

    Example:
        >>> a = torch.arange(7, dtype=torch.float64)
        >>> s = spectrum(torch.cos(0.5 + 2 * math.pi * 3 * a / 7))
        >>> int(s["frequency"]), round(float(s["power"]), 6), round(float(s["phase"]), 6)
        (3, 1.0, 0.5)
    """
    coeffs = torch.fft.rfft(vectors.double(), dim=-1)
    power = coeffs.abs().square()
    power[..., 1:] *= 2  # one-sided: each nonzero frequency holds its mirror's power too
    if vectors.shape[-1] % 2 == 0:
        power[..., -1] /= 2  # the Nyquist term has no mirror
    best = power[..., 1:].argmax(-1) + 1
    share = power.gather(-1, best.unsqueeze(-1)).squeeze(-1) / power.sum(-1).clamp_min(1e-300)
    phase = coeffs.gather(-1, best.unsqueeze(-1)).squeeze(-1).angle()
    return {"frequency": best, "power": share, "phase": phase}


def neuron_spectra(U: torch.Tensor, W: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per neuron (``U`` ``[k, p, m]``, ``W`` ``[m, p]``): the smallest max-normalised power over its ``k + 1``
    vectors (``power`` ``[m]``), whether they share one dominant frequency (``shared`` ``[m]``, bool), that
    frequency (``frequency``: ``w_i``'s), and the phase residual ``theta_{u_1} + ... + theta_{u_k} - theta_w``
    wrapped to ``(-pi, pi]`` (``phase_residual``; Theorem 4.9 predicts 0).

    Example:
        >>> a = torch.arange(5, dtype=torch.float64)
        >>> wave = lambda phase: torch.cos(phase + 2 * math.pi * 2 * a / 5)
        >>> U = torch.stack([wave(0.3), wave(0.4)]).unsqueeze(-1)  # k = 2 inputs, one neuron
        >>> s = neuron_spectra(U, wave(0.7).unsqueeze(0))
        >>> bool(s["shared"].all()), int(s["frequency"].sum()), float(s["phase_residual"].abs().max()) < 1e-12
        (True, 2, True)
    """
    per_input = spectrum(U.permute(2, 0, 1))  # [m, k]
    out = spectrum(W)  # [m]
    freq = torch.cat([per_input["frequency"], out["frequency"].unsqueeze(1)], 1)
    power = torch.cat([per_input["power"], out["power"].unsqueeze(1)], 1)
    residual = per_input["phase"].sum(1) - out["phase"]
    return {"power": power.amin(1), "shared": (freq == freq[:, :1]).all(1), "frequency": out["frequency"],
            "phase_residual": torch.remainder(residual + math.pi, 2 * math.pi) - math.pi}


def frequency_coverage(frequency: torch.Tensor, p: int) -> torch.Tensor:
    """Neurons per dominant frequency ``1 .. (p-1)/2`` (``[(p-1)/2]``; the chapter predicts every one used).

    Example:
        >>> frequency_coverage(torch.tensor([1, 1, 3]), 7).tolist()
        [2, 0, 1]
    """
    return torch.bincount(frequency - 1, minlength=(p - 1) // 2)[: (p - 1) // 2]


def max_margin_network(k: int, p: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Lemma 4.11's maximum-margin network, ``(U [k, p, m], W [m, p])`` with ``m = 2^(2k-2)(p-1)`` and
    ``||theta||_{2,k+1} = 1``: it computes ``sum_zeta cos(2 pi zeta (a_1 + ... + a_k - c) / p)`` up to scale.

    Why it works: ``cos`` of a sum expands into the ``2^k`` products of ``cos``/``sin`` of each ``a_j`` and of
    ``-c`` with an even number of ``sin`` factors (sign -1 when that number is 2 mod 4); the product of the k input
    factors is ``sum_s (-1)^((k - sum s)/2) (sum_j s_j d_j)^k / (2^k k!)`` over signs ``s`` in ``{+-1}^k``, where
    ``s`` and ``-s`` give the same term, so ``2^(k-1)`` neurons per product and ``2^(2k-1)`` per frequency. Every
    neuron has the same norm; each is balanced (``u`` scaled by ``t``, ``w`` by ``t^-k``, the function unchanged)
    to the smallest norm, then the whole network is scaled to norm 1.

    Example:
        >>> U, W = max_margin_network(3, 5)
        >>> U.shape, W.shape, round(float(norm_2_kplus1(U, W)), 12)
        (torch.Size([3, 5, 64]), torch.Size([64, 5]), 1.0)
    """
    a = torch.arange(p, dtype=dtype)
    scale = 2 / (2 ** k * math.factorial(k))  # s and -s give one neuron: twice 1/(2^k k!)
    inputs, outputs = [], []
    for zeta in range(1, (p - 1) // 2 + 1):
        cos, sin = torch.cos(2 * math.pi * zeta * a / p), torch.sin(2 * math.pi * zeta * a / p)
        for b in itertools.product((0, 1), repeat=k + 1):
            if sum(b) % 2:
                continue
            sign = -1.0 if sum(b) % 4 == 2 else 1.0
            factors = [sin if bit else cos for bit in b[:k]]
            out = -sin if b[k] else cos  # cos / sin of -2 pi zeta c / p
            for tail in itertools.product((1, -1), repeat=k - 1):
                s = (1, *tail)
                inputs.append(torch.stack([sj * d for sj, d in zip(s, factors)]))
                outputs.append(sign * scale * (-1) ** ((k - sum(s)) // 2) * out)
    U, W = torch.stack(inputs, -1), torch.stack(outputs)
    t = (k * W.square().sum(1) / U.square().sum((0, 1))) ** (1 / (2 * k + 2))  # argmin t^2|u|^2 + |w|^2 / t^2k
    U, W = U * t, W / t.unsqueeze(1) ** k
    norm = norm_2_kplus1(U, W)  # homogeneous of degree 1 in theta: divide every weight by it
    return U / norm, W / norm


def key_frequency_part(residue_means: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """The part of a ``[p, p]`` table (row ``s``: a residue's mean logits over the classes) made of the Fourier
    modes over ``s`` at ``frequencies`` (in ``1 .. (p-1)/2``), each class's mean over ``s`` excluded.

    Example:
        >>> s = torch.arange(7, dtype=torch.float64).unsqueeze(1)
        >>> table = 2 + torch.cos(2 * math.pi * 3 * s / 7) + torch.sin(2 * math.pi * s / 7)  # every class alike
        >>> part = key_frequency_part(table.expand(7, 7), torch.tensor([3]))
        >>> bool(torch.allclose(part, torch.cos(2 * math.pi * 3 * s / 7).expand(7, 7)))
        True
    """
    p = residue_means.shape[0]
    coeffs = torch.fft.rfft(residue_means.double(), dim=0)
    keep = torch.zeros(coeffs.shape[0], dtype=torch.bool, device=coeffs.device)
    keep[frequencies.to(torch.int64)] = True
    keep[0] = False
    return torch.fft.irfft(coeffs * keep.unsqueeze(1), n=p, dim=0)


def ablation_losses(residue_means: torch.Tensor, frequencies: torch.Tensor, logits: torch.Tensor,
                    y: torch.Tensor, part: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Nanda et al.'s restricted and excluded losses for k inputs, from the ``[p, p]`` per-residue mean logits
    over all ``p^k`` tuples and one split's logits ``[N, p]`` with labels ``y`` (a tuple's residue is its label):

    * ``restricted``: the cross-entropy, over all tuples, of logits made of each class's mean and the key
      frequencies' part only (they depend on the residue alone, so the table gives it exactly);
    * ``excluded``: the split's mean cross-entropy after the key frequencies' part is subtracted from its logits.

    ``part``: :func:`key_frequency_part` of the table, where the caller has it already (a split in chunks).

    Example:
        >>> p = 5
        >>> s = torch.arange(p, dtype=torch.float64)
        >>> table = 4 * torch.cos(2 * math.pi * (s.unsqueeze(1) - s) / p)  # the circuit at frequency 1
        >>> out = ablation_losses(table, torch.tensor([1]), table, torch.arange(p))
        >>> full = F.cross_entropy(table, torch.arange(p))  # all of it is the circuit; excluded = log p
        >>> round(float(out["restricted"] - full), 12), round(float(out["excluded"]), 4), round(math.log(p), 4)
        (0.0, 1.6094, 1.6094)
    """
    part = key_frequency_part(residue_means, frequencies) if part is None else part
    restricted = F.cross_entropy(residue_means.double().mean(0) + part, torch.arange(len(part), device=part.device))
    excluded = F.cross_entropy(logits.double() - part[y], y)
    return {"restricted": restricted, "excluded": excluded}
