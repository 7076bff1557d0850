"""Stop-gradient InfoNCE (Wen & Li 2021, Def. 2.2), streamed over the negatives.

``loss_k = -<a_k, q_k> + tau * logsumexp([<a_k,q_k>, <a_k,n_s>]_s / tau)`` with the positive ``q`` and the
negatives treated as constants, so only the anchor receives gradient:
``dL/df(a) = -(1 - l_p) f(q) + sum_s l_s f(n_s)`` (Wen & Li 2021, App. A.1, sign corrected;
:func:`infonce_grad_closed_form`).

Backend: PyTorch only, no ``backend=`` argument. The op is two small GEMMs per chunk of negatives
(similarities, then the softmax-weighted sum of the negatives), which cuBLAS already runs at roofline, so
there is no Triton kernel. Negatives (a shared pool ``[N, m]`` or per anchor ``[K, N, m]``) are streamed in
chunks with an online logsumexp: memory ``O(K * chunk)`` (one ``K x chunk`` similarity block alive) plus
the ``[K, m]`` closed-form gradient the forward saves; ``4 K N m`` FLOPs, no ``K x N`` matrix kept.

Example:
    >>> import torch
    >>> a = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    >>> q, n = torch.randn(4, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    >>> loss, p_pos = infonce_stopgrad(a, q, n, 2.0, chunk_size=5)
    >>> bool(torch.allclose(loss, infonce_reference(a, q, n, 2.0)))
    True
"""
from __future__ import annotations

import torch

from featlearn.errors import ConfigError
from featlearn.kernels.backend import check_float_inputs, profiled, refuse_shape

__all__ = ["infonce_stopgrad", "infonce_reference", "infonce_grad_closed_form", "InfoNCEStopGradFunction"]


# ----------------------------------------------------------------------------------------------
# PyTorch implementation
# ----------------------------------------------------------------------------------------------
def _similarities(h_anchor: torch.Tensor, h_neg: torch.Tensor) -> torch.Tensor:
    """``[K, n]`` dot products with a shared pool ``[n, m]`` or per-anchor negatives ``[K, n, m]``."""
    if h_neg.dim() == 2:
        return h_anchor @ h_neg.t()
    return torch.einsum("km,knm->kn", h_anchor, h_neg)


def _aggregate(p: torch.Tensor, h_neg: torch.Tensor) -> torch.Tensor:
    if h_neg.dim() == 2:
        return p @ h_neg
    return torch.einsum("kn,knm->km", p, h_neg)


def _infonce_fwd_torch(ha, hq, hn, tau, chunk):
    """Streaming InfoNCE: per-anchor loss, l_p and the closed-form gradient g (no grad tracking)."""
    s_pos = (ha * hq).sum(-1)
    run_max = s_pos / tau
    run_sum = torch.ones_like(s_pos)
    out = hq  # sum_x exp(s_x/tau - run_max) f(x), positive first
    n = hn.shape[-2]
    for start in range(0, n, chunk):
        block = hn[start:start + chunk] if hn.dim() == 2 else hn[:, start:start + chunk]
        logits = _similarities(ha, block) / tau  # the only K x chunk matrix alive
        new_max = torch.maximum(run_max, logits.amax(-1))
        scale = torch.exp(run_max - new_max)
        probs = logits.sub_(new_max.unsqueeze(-1)).exp_()  # in place: still the one K x chunk matrix
        run_sum = run_sum * scale + probs.sum(-1)
        out = out * scale.unsqueeze(-1) + _aggregate(probs, block)
        run_max = new_max
        del logits, probs
    lse = run_max + torch.log(run_sum)
    loss = -s_pos + tau * lse
    p_pos = torch.exp(s_pos / tau - lse)
    grad = out / run_sum.unsqueeze(-1) - hq
    return loss, p_pos, grad


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------
class InfoNCEStopGradFunction(torch.autograd.Function):
    """``forward(ctx, h_anchor, h_pos, h_neg, tau, chunk) -> (loss, p_pos)``; saves only the closed-form
    gradient ``[K, m]``, so the backward is one broadcast multiply."""

    @staticmethod
    def forward(ctx, ha, hq, hn, tau, chunk):
        loss, p_pos, grad = _infonce_fwd_torch(ha, hq.detach(), hn.detach(), tau, chunk)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(p_pos)
        return loss, p_pos

    @staticmethod
    def backward(ctx, grad_loss, grad_p):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.unsqueeze(-1), None, None, None, None


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
@profiled
def infonce_stopgrad(h_anchor: torch.Tensor, h_pos: torch.Tensor, h_neg: torch.Tensor, temperature: float,
                     chunk_size: int | None = None, *, vmappable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor stop-gradient InfoNCE (Wen & Li 2021, Def. 2.2) and the positive's softmax weight.

    ``loss_k = -<a_k, q_k> + tau * logsumexp([<a_k,q_k>, <a_k,n_s>]_s / tau)`` with ``q`` and the
    negatives treated as constants. Negatives are a shared pool ``[N, m]`` or per anchor ``[K, N, m]``;
    they are streamed in blocks of ``chunk_size`` (default: all at once), so memory is
    ``O(K * chunk)``. The backward pass is the closed form ``g = O - f(q)`` (no K x N matrix saved).

    Returns ``(loss [K], p_pos [K])``; ``p_pos`` carries no gradient. ``vmappable``: plain PyTorch ops instead of
    the autograd.Function, which ``torch.func.vmap`` can batch (a seed stack's step): the same loss, ``p_pos`` and
    anchor gradient, bit for bit (the closed form enters as ``loss + <a, g> - sg(<a, g>)``, whose value is the
    loss and whose gradient is ``g`` times the incoming one, the Function's product).

    Example:
        >>> a = torch.randn(4, 8, requires_grad=True)
        >>> loss, p = infonce_stopgrad(a, torch.randn(4, 8), torch.randn(16, 8), 2.0, chunk_size=5)
        >>> loss.mean().backward(); a.grad.shape
        torch.Size([4, 8])
    """
    check_float_inputs("infonce_stopgrad", h_anchor=h_anchor, h_pos=h_pos, h_neg=h_neg)
    if temperature <= 0:
        raise ConfigError("temperature", "> 0", temperature)
    if h_neg.dim() not in (2, 3):
        refuse_shape("infonce_stopgrad", "h_neg", h_neg, "must be [N, m] or [K, N, m]")
    n = h_neg.shape[-2]
    chunk = n if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ConfigError("chunk_size", "a positive integer or None", chunk_size)
    if vmappable:
        with torch.no_grad():
            loss, p_pos, grad = _infonce_fwd_torch(h_anchor, h_pos.detach(), h_neg.detach(), float(temperature), chunk)
        pull = (h_anchor * grad).sum(-1)
        return loss + (pull - pull.detach()), p_pos
    return InfoNCEStopGradFunction.apply(h_anchor, h_pos, h_neg, float(temperature), chunk)


def infonce_grad_closed_form(h_anchor: torch.Tensor, h_pos: torch.Tensor, h_neg: torch.Tensor,
                             temperature: float) -> torch.Tensor:
    """The gradient of Wen & Li 2021, App. A.1, sign corrected: ``dL/df(a) = -(1 - l_p) f(q) + sum_s l_s f(n_s)`` per
    anchor ``[K, m]``.

    (The paper prints ``+(1 - l_p)``, a sign error.)
    """
    s = torch.cat([(h_anchor * h_pos).sum(-1, keepdim=True), _similarities(h_anchor, h_neg)], -1) / temperature
    soft = torch.softmax(s, dim=-1)
    l_p, l_s = soft[:, 0], soft[:, 1:]
    return -(1 - l_p).unsqueeze(-1) * h_pos + _aggregate(l_s, h_neg)


# ----------------------------------------------------------------------------------------------
# float64 reference
# ----------------------------------------------------------------------------------------------
def infonce_reference(h_anchor: torch.Tensor, h_pos: torch.Tensor, h_neg: torch.Tensor,
                      temperature: float) -> torch.Tensor:
    """Autograd reference: ``tau * cross_entropy`` over ``[s_pos, S]`` with detached keys. Returns ``[K]``."""
    q, n = h_pos.detach(), h_neg.detach()
    logits = torch.cat([(h_anchor * q).sum(-1, keepdim=True), _similarities(h_anchor, n)], dim=-1) / temperature
    target = torch.zeros(h_anchor.shape[0], dtype=torch.long, device=h_anchor.device)
    return temperature * torch.nn.functional.cross_entropy(logits, target, reduction="none")
