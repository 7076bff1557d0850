"""Fused loops of the looped linear transformer (Shi 2024, Ch. 8: Giannou et al. 2023's construction, Theorem
8.14), for a batch of prompts b with Gram matrices ``G_b = E_b^T E_b`` ``[D, D]`` (``E_b = [X_b, y_b]``, D = d + 1)::

    U_b = Q G_b P,     z_t = z_{t-1} - eta_t z_{t-1} U_b     (t = 1 .. T, row vectors z_t of length D)

returning every loop's row ``Z[b, t] = z_t`` (``z_0`` first), so one call serves any loop count up to T. The
backward runs the loops backwards with the adjoint ``a_t = dL/dz_t``::

    a_T = gZ[T],   a_{t-1} = gZ[t-1] + a_t (I - eta_t U_b)^T,   d eta_t = -sum_b <a_t, z_{t-1} U_b>,
    dU_b = -sum_t eta_t z_{t-1}^T a_t,   dQ = sum_b dU_b (G_b P)^T,   dP = sum_b (Q G_b)^T dU_b,
    dG_b = Q^T dU_b P^T,   dz_0 = a_0

Backends (``backend="auto"`` picks Triton for CUDA tensors), both saving G, Q, P, eta and Z (U is recomputed):

* ``triton``: the forward is one program per block of prompts: it forms ``U_b`` in registers (D rank-1
  updates, ``D`` padded to a power of two ``DP``), then runs the T loops there, writing each ``z_t``; no
  ``[B, D, D]`` temporary touches memory. The backward kernel recomputes ``U_b``, runs the adjoint loop
  (reading ``z_{t-1}`` from Z), and writes ``dU_b``, ``dz_0`` and per-prompt ``d eta`` terms ``[B, T]``
  (summed over b by PyTorch, a fixed order); ``dQ``, ``dP``, ``dG`` are batched GEMMs in PyTorch.
  Products are elementwise FMAs in the inputs' dtype (no ``tl.dot``: ``D`` is at most 64 and each prompt
  has its own U), so float32 runs are IEEE float32 throughout. ``D <= 64``.
* ``torch``: the same algebra, a batched GEMM per loop forward and backward; it runs under
  ``torch.func.vmap`` (a module's seeds in one call). Any D.

Cost per prompt: ``2 D^3`` FMAs to form U, ``T D^2`` per forward and ``3 T D^2`` per backward (plus ``2 D^3``
again to recompute U, and ``2 D^3`` for dQ and dP); memory: Z (``B (T+1) D``) written once and read once by the
backward, beside one read of G and the gradient ``gZ``.

Dtypes follow the shared policy of ``featlearn.kernels.backend``: every tensor float32 or every tensor float64.

Example:
    >>> import torch
    >>> from featlearn.kernels.looped_linear_attention import (looped_linear_attention,
    ...                                                        looped_linear_attention_reference)
    >>> E, z0, eta = torch.randn(3, 8, 4), torch.randn(3, 4), torch.full((5,), 0.01)
    >>> G, Q, P = E.mT @ E, torch.eye(4), torch.randn(4, 4)
    >>> Z = looped_linear_attention(G, z0, Q, P, eta, backend="torch")
    >>> Z.shape, bool(torch.allclose(Z, looped_linear_attention_reference(G, z0, Q, P, eta), atol=1e-5))
    (torch.Size([3, 6, 4]), True)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from featlearn.kernels import backend as kb  # kb.new_output: the allocation tests poison
from featlearn.kernels.backend import (KernelInputError, acc_dtype, autotune, check_backend, check_float_inputs,
                                       contiguous, refuse_shape, resolve_backend, tile_grid)

__all__ = ["looped_linear_attention", "looped_linear_attention_reference", "LoopedLinearAttentionFunction"]

MAX_DIM = 64  # U_b and dU_b live in registers: [BLOCK_B, DP, DP] each

# (BLOCK_B, WARPS): BLOCK_B prompts per program of WARPS warps (WARPS is the config's num_warps, a constexpr so that
# `fits` sees it). `fits` keeps a tile while U takes at most _PER_THREAD[kind] values a thread, on four warps for
# DP <= 32 and on 8 or 16 for the largest U (DP = 64, whose reductions then cross warps). The limits are what
# the sm_90 builds keep spill-free at D = 5, 16, 21 and 64 under triton 3.6 and 3.9 (`featlearn gpu compile
# --all-configs --op looped_linear_attention`): the backward, whose dU doubles U's registers, spills first
# (float64 at 16 a thread under 3.6, float32 at 32 with DP = 64). (4, 4) puts one prompt on each warp. Not yet
# timed on a GPU.
_SHAPES = ((4, 4), (2, 4), (1, 4), (8, 4), (16, 4), (1, 8), (1, 16))
_TILES = tuple((b, w, w, 2) for b, w in _SHAPES)
_PER_THREAD = {"fp32": (32, 16), "fp64": (8, 8)}  # (DP <= 32, DP = 64)
_INTERPRETER_TILE = (2, 4)  # odd test batches end in a partial block


def _fits(config: dict, args: dict) -> bool:
    largest = args["DP"] == MAX_DIM
    limit = _PER_THREAD["fp64" if args["ACC"] == tl.float64 else "fp32"][largest]
    return config["BLOCK_B"] * args["DP"] ** 2 <= limit * 32 * config["WARPS"] and (config["WARPS"] > 4) == largest


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _looped_attn_update(g_ptr, q_ptr, p_ptr, rb, B, D, DP: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr):
    # U_b = sum_k Q[:, k] (G_b P)[k, :]: the row (G_b P)[k, :] is the loaded row G_b[k, :] times P in registers,
    # so no row ever has to be taken out of a register tensor
    ri = tl.arange(0, DP)
    dmask = ri < D
    p = tl.load(p_ptr + ri[:, None] * D + ri[None, :], mask=dmask[:, None] & dmask[None, :], other=0.0).to(ACC)
    gmask = (rb[:, None] < B) & dmask[None, :]
    u = tl.zeros((BLOCK_B, DP, DP), dtype=ACC)
    for k in range(0, D):
        g_k = tl.load(g_ptr + (rb[:, None] * D + k) * D + ri[None, :], mask=gmask, other=0.0).to(ACC)
        gp_k = tl.sum(g_k[:, :, None] * p[None, :, :], axis=1)
        q_k = tl.load(q_ptr + ri * D + k, mask=dmask, other=0.0).to(ACC)
        u += q_k[None, :, None] * gp_k[:, None, :]
    return u


@autotune(("BLOCK_B", "WARPS"), _TILES, _INTERPRETER_TILE, fits=_fits, key=["D"])
@triton.jit
def _looped_attn_fwd_kernel(g_ptr, z0_ptr, q_ptr, p_ptr, eta_ptr, z_ptr, B, D, T, DP: tl.constexpr,
                            ACC: tl.constexpr, BLOCK_B: tl.constexpr, WARPS: tl.constexpr):
    # U_b and z stay in registers across the T loops: only the rows z_t go to memory
    rb = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    ri = tl.arange(0, DP)
    mask = (rb[:, None] < B) & (ri[None, :] < D)
    u = _looped_attn_update(g_ptr, q_ptr, p_ptr, rb, B, D, DP, ACC, BLOCK_B)
    z = tl.load(z0_ptr + rb[:, None] * D + ri[None, :], mask=mask, other=0.0).to(ACC)
    rows = rb[:, None] * (T + 1) * D + ri[None, :]  # Z[b, t, :] is at rows + t D
    tl.store(z_ptr + rows, z.to(z_ptr.dtype.element_ty), mask=mask)
    for t in range(1, T + 1):
        eta = tl.load(eta_ptr + t - 1).to(ACC)
        z = z - eta * tl.sum(z[:, :, None] * u, axis=1)
        tl.store(z_ptr + rows + t * D, z.to(z_ptr.dtype.element_ty), mask=mask)


@autotune(("BLOCK_B", "WARPS"), _TILES, _INTERPRETER_TILE, fits=_fits, key=["D"])
@triton.jit
def _looped_attn_bwd_adjoint_kernel(g_ptr, q_ptr, p_ptr, eta_ptr, z_ptr, gz_ptr, du_ptr, deta_ptr, dz0_ptr, B, D, T,
                                    DP: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr, WARPS: tl.constexpr):
    # the adjoint a_t from t = T down to 0, with dU_b accumulated in registers and d eta_t per prompt
    rb = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    ri = tl.arange(0, DP)
    mask = (rb[:, None] < B) & (ri[None, :] < D)
    u = _looped_attn_update(g_ptr, q_ptr, p_ptr, rb, B, D, DP, ACC, BLOCK_B)
    rows = rb[:, None] * (T + 1) * D + ri[None, :]
    a = tl.load(gz_ptr + rows + T * D, mask=mask, other=0.0).to(ACC)
    du = tl.zeros((BLOCK_B, DP, DP), dtype=ACC)
    for s in range(0, T):
        t = T - s
        eta = tl.load(eta_ptr + t - 1).to(ACC)
        zp = tl.load(z_ptr + rows + (t - 1) * D, mask=mask, other=0.0).to(ACC)
        v = tl.sum(zp[:, :, None] * u, axis=1)  # z_{t-1} U_b
        tl.store(deta_ptr + rb * T + t - 1, (-tl.sum(a * v, axis=1)).to(deta_ptr.dtype.element_ty), mask=rb < B)
        du = du - eta * (zp[:, :, None] * a[:, None, :])
        g = tl.load(gz_ptr + rows + (t - 1) * D, mask=mask, other=0.0).to(ACC)
        a = g + a - eta * tl.sum(u * a[:, None, :], axis=2)
    tl.store(dz0_ptr + rb[:, None] * D + ri[None, :], a.to(dz0_ptr.dtype.element_ty), mask=mask)
    cell = (rb[:, None, None] * D + ri[None, :, None]) * D + ri[None, None, :]
    tl.store(du_ptr + cell, du.to(du_ptr.dtype.element_ty), mask=mask[:, :, None] & (ri[None, None, :] < D))


# ----------------------------------------------------------------------------------------------
# launchers and PyTorch fallback: Z forward, (dU, d eta, dz0) backward, then the GEMMs to dG, dQ, dP
# ----------------------------------------------------------------------------------------------
def _dim_tile(D: int) -> int:
    return max(2, triton.next_power_of_2(D))


def _looped_attn_fwd_triton(G, z0, Q, P, eta):
    B, D = z0.shape
    T = eta.shape[0]
    Z = kb.new_output((B, T + 1, D), G)
    _looped_attn_fwd_kernel[tile_grid((B, "BLOCK_B"))](G, z0, Q, P, eta, Z, B, D, T, DP=_dim_tile(D),
                                                        ACC=acc_dtype(G))
    return Z


def _looped_attn_bwd_triton(grad, G, Q, P, eta, Z):
    (grad,) = contiguous(grad)
    B, D = Z.shape[0], Z.shape[2]
    T = eta.shape[0]
    du, deta, dz0 = kb.new_output((B, D, D), G), kb.new_output((B, T), G), kb.new_output((B, D), G)
    _looped_attn_bwd_adjoint_kernel[tile_grid((B, "BLOCK_B"))](G, Q, P, eta, Z, grad, du, deta, dz0, B, D, T,
                                                                DP=_dim_tile(D), ACC=acc_dtype(G))
    return du, deta.sum(0), dz0


def _looped_attn_fwd_torch(G, z0, Q, P, eta):
    U = Q @ G @ P
    z = z0.unsqueeze(1)
    zs = [z]
    for e in (-eta).unbind(0):  # z + (-eta_t) z U in one addcmul: per-op overhead is the time at small D
        z = torch.addcmul(z, e, z @ U)
        zs.append(z)
    return torch.cat(zs, 1)


def _looped_attn_bwd_torch(grad, G, Q, P, eta, Z):
    T = eta.shape[0]
    Ut = (Q @ G @ P).mT
    g, neg = grad.split(1, 1), (-eta).unbind(0)
    a = g[T]
    adjoints = [a]
    for t in range(T - 1, -1, -1):  # a_t for t = T-1 .. 0; only this step is sequential
        a = torch.addcmul(g[t] + a, neg[t], a @ Ut)
        adjoints.append(a)
    A = torch.cat(adjoints[-2::-1], 1)  # a_1 .. a_T  [B, T, D]
    Zp = Z[:, :T]
    deta = -(A * (Zp @ Ut.mT)).sum((0, 2))
    du = -(Zp.mT @ (A * eta.unsqueeze(-1)))
    return du, deta, a.squeeze(1)


def _looped_attn_weight_grads(du, G, Q, P, need):
    """(dG, dQ, dP) from dU, each where ``need`` (G, Q, P) asks for it."""
    dG = Q.mT @ du @ P.mT if need[0] else None
    dQ = torch.einsum("bij,bkj->ik", du @ P.mT, G) if need[1] else None
    dP = torch.einsum("bki,bkj->ij", G, Q.mT @ du) if need[2] else None
    return dG, dQ, dP


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------
class LoopedLinearAttentionFunction(torch.autograd.Function):
    """``forward(G, z0, Q, P, eta, backend) -> Z``; both backends save G, Q, P, eta and Z."""

    generate_vmap_rule = True  # the torch backend under torch.func.vmap: a module's seeds stepped in one call

    @staticmethod
    def forward(G, z0, Q, P, eta, backend):
        if backend == "triton":
            return _looped_attn_fwd_triton(G, z0, Q, P, eta)
        return _looped_attn_fwd_torch(G, z0, Q, P, eta)

    @staticmethod
    def setup_context(ctx, inputs, output):
        G, _, Q, P, eta, backend = inputs
        ctx.save_for_backward(G, Q, P, eta, output)
        ctx.backend = backend

    @staticmethod
    @once_differentiable  # the Triton gradients are not differentiable: both backends refuse a double backward
    def backward(ctx, grad):
        G, Q, P, eta, Z = ctx.saved_tensors
        need_G, need_z0, need_Q, need_P, need_eta = ctx.needs_input_grad[:5]
        if ctx.backend == "triton":
            du, deta, dz0 = _looped_attn_bwd_triton(grad, G, Q, P, eta, Z)
        else:
            du, deta, dz0 = _looped_attn_bwd_torch(grad, G, Q, P, eta, Z)
        dG, dQ, dP = _looped_attn_weight_grads(du, G, Q, P, (need_G, need_Q, need_P))
        return dG, dz0 if need_z0 else None, dQ, dP, deta if need_eta else None, None


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
@kb.profiled
def looped_linear_attention(G: torch.Tensor, z0: torch.Tensor, Q: torch.Tensor, P: torch.Tensor, eta: torch.Tensor,
                            *, backend: str = "auto") -> torch.Tensor:
    """Every loop's query row ``Z[b, t] = z_t``, ``z_t = z_{t-1} (I - eta_t Q G_b P)``, differentiable in all inputs.

    Args:
        G: ``[B, D, D]`` per-prompt matrices (the prompts' Gram matrices ``E_b^T E_b``; not assumed symmetric).
        z0: ``[B, D]`` the query rows before the first loop.
        Q, P: ``[D, D]`` the weights shared by every prompt and loop.
        eta: ``[T]`` the step sizes of loops 1 .. T, ``T >= 1``.
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"torch"`` or ``"triton"`` (``D <= 64``).

    Every tensor is float32 or every tensor float64, all on one device.

    Returns ``Z`` ``[B, T + 1, D]`` in G's dtype, ``Z[:, 0] = z0``.
    """
    op = "looped_linear_attention"
    check_backend(backend)
    check_float_inputs(op, G=G, z0=z0, Q=Q, P=P, eta=eta)
    if G.dim() != 3 or G.shape[1] != G.shape[2] or G.shape[0] < 1 or G.shape[1] < 1:
        refuse_shape(op, "G", G, "must be a 3-D tensor [B, D, D] with B >= 1 and D >= 1")
    B, D = G.shape[:2]
    for name, t, shape in (("z0", z0, (B, D)), ("Q", Q, (D, D)), ("P", P, (D, D))):
        if tuple(t.shape) != shape:
            refuse_shape(op, name, t, f"must be a tensor [{', '.join(map(str, shape))}] (G is [{B}, {D}, {D}])")
    if eta.dim() != 1 or eta.shape[0] < 1:
        refuse_shape(op, "eta", eta, "must be a 1-D tensor [T] of step sizes with T >= 1")
    for name, t in (("z0", z0), ("Q", Q), ("P", P), ("eta", eta)):
        if t.device != G.device:
            raise KernelInputError(op, name, f"is on {t.device}", f"must be on G's device {G.device}", str(t.device))
    which = resolve_backend(backend, G, z0, Q, P, eta)
    if which == "triton":
        if D > MAX_DIM:
            refuse_shape(op, "G", G, f"must have D <= {MAX_DIM} on the Triton backend (U lives in registers); "
                                     "backend='torch' takes any D")
        G, z0, Q, P, eta = contiguous(G, z0, Q, P, eta)
    return LoopedLinearAttentionFunction.apply(G, z0, Q, P, eta, which)


# ----------------------------------------------------------------------------------------------
# float64 reference
# ----------------------------------------------------------------------------------------------
def looped_linear_attention_reference(G: torch.Tensor, z0: torch.Tensor, Q: torch.Tensor, P: torch.Tensor,
                                      eta: torch.Tensor) -> torch.Tensor:
    """Plain autograd reference: the loop ``z <- z - eta_t z (Q G P)``, every ``z_t`` stacked. Run it in float64."""
    update = Q @ G @ P
    z, out = z0.unsqueeze(1), [z0]
    for t in range(eta.shape[0]):
        z = z - eta[t] * (z @ update)
        out.append(z.squeeze(1))
    return torch.stack(out, 1)
