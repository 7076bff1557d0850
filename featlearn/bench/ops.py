"""Op cases of ``featlearn bench op``: each fused op against the eager PyTorch a user would write (one GEMM
plus elementwise passes), ``torch.compile`` of that eager code, the op's PyTorch backend (what
``backend="auto"`` runs on CPU) and, on CUDA, its Triton backend. Forward plus the backward training
needs: gradients only of what a training step differentiates (W, not the data; the online branch, not
the stop-gradient target).

Sizes: ``smoke`` (CI), ``tiny`` (the CPU sizes of the specs), ``medium`` (the specs' GPU sizes), ``gpu``
(CUDA only: the specs' GPU sizes, batch dimensions raised where needed so that each op's call takes
~1-50 ms on an H100; the sizes ``featlearn gpu check`` part 2 times). The fused ops run with IEEE float32
dots, as the methods run them, so on a GPU they do the eager code's arithmetic (cuBLAS with TF32 off).

On CUDA every op with dots also gets TF32 variants beside the IEEE ones (``eager tf32``: cuBLAS TF32;
``featlearn triton tf32``), masked attention an SDPA variant with PyTorch's own kernel choice, and each
case carries its model FLOPs and fewest bytes, so the tables give achieved TFLOP/s and GB/s (as shares of
the ceilings ``featlearn gpu check`` measures). At ``gpu`` only the cases in :data:`COMPILED_AT_GPU` get a
``torch.compile`` variant: each compile costs ~10-30 s, and the check has 5 minutes for all of part 2.
Inputs are drawn on the device (a CUDA generator on CUDA: the GPU sizes hold GBs of float64 draws).
"""
from __future__ import annotations

import functools

import torch

from featlearn.bench.harness import COMPILED, EAGER, TF32_TOLERANCE, Case, Variant, away_from_kinks
from featlearn.kernels.backend import cublas_precision
from featlearn.kernels import (Activation, smoothed_relu, bn_cosine_loss, bn_cosine_loss_reference, infonce_reference,
                               infonce_stopgrad, patch_activation_sum, patch_activation_sum_reference,
                               soft_threshold_layer, soft_threshold_reference)
from featlearn.kernels.looped_linear_attention import looped_linear_attention, looped_linear_attention_reference
from featlearn.kernels.masked_attention import masked_attention
from featlearn.kernels.modular_power_mlp import modular_power_mlp, modular_power_mlp_reference
from featlearn.kernels.registry import OPS as REGISTRY
from featlearn.kernels.smoothed_clamp import smoothed_clamp_layer, smoothed_clamp_reference
from featlearn.kernels.token_selection import selection_scores, sorted_top_k

SIZES = ("smoke", "tiny", "medium", "gpu")

# patch_activation_sum: the teacher-student hot loop of MRP (medium: configs/mrp/teacher_student_medium.yaml): smoothed
# ReLU q=3 rho=0.25, masked student, teacher at tau=1.5 (no grad), masked squares; keep-0.5 mask
PATCH = {"smoke": dict(B=12, P=5, d=24, R=7), "tiny": dict(B=1000, P=16, d=256, R=30),
         "medium": dict(B=16384, P=32, d=1024, R=512), "gpu": dict(B=16384, P=32, d=1024, R=512)}
Q, RHO, TAU = 3, 0.25, 1.5
# soft_threshold (contrastive sizes d1 = 8d, m = 4d; medium: d = 256): B rows, d1 inputs, m neurons; gpu: the medium
# encoder's B = K + N = 5120 rows
SOFT = {"smoke": dict(B=16, d1=24, m=8), "tiny": dict(B=256, d1=256, m=128), "medium": dict(B=1024, d1=2048, m=1024),
        "gpu": dict(B=5120, d1=2048, m=1024)}
# bn_cosine_loss (non-contrastive): N rows, m = 2 (the theory's width) and a wider m; gpu: the float64
# N = 8192, m = 2 (launch-bound whatever the size) and a float32 stream of 270 MB
BN = {"smoke": [dict(N=64, m=2)], "tiny": [dict(N=4096, m=2), dict(N=4096, m=64)],
      "medium": [dict(N=4096, m=2), dict(N=4096, m=1024)],
      "gpu": [dict(N=8192, m=2, dtype=torch.float64), dict(N=65536, m=1024)]}
# infonce_stopgrad (contrastive sizes; medium: d = 256): K anchors, N shared negatives, m features; gpu: 4x the medium
# anchors
INFONCE = {"smoke": dict(K=16, N=24, m=8), "tiny": dict(K=256, N=256, m=128), "medium": dict(K=1024, N=4096, m=1024),
           "gpu": dict(K=4096, N=4096, m=1024)}
# masked_attention (the ViT MAE's dense path): B samples, P keys, Pq = gamma P masked queries (shared rows
# gathered by index, gamma = 0.75), d = dv; medium ends at configs/vit/mae_p1024_pos.yaml's size
ATTN = {"smoke": [dict(B=2, P=24, Pq=18, d=40)], "tiny": [dict(B=8, P=256, Pq=192, d=320)],
        "medium": [dict(B=64, P=256, Pq=192, d=320), dict(B=64, P=1024, Pq=768, d=1152)],
        "gpu": [dict(B=64, P=1024, Pq=768, d=1152)]}
# smoothed_clamp_layer (the two-layer network of Shi 2024, Ch. 2): B samples, d inputs, M = 2m neurons, smoothing s =
# 1/k^2 (steps 1-2);
# tiny = a minibatch step of Table A.1, medium = a full-batch step (n = 50,000) at Table A.3's d = 2000
CLAMP = {"smoke": dict(B=16, d=24, M=10), "tiny": dict(B=1000, d=500, M=600), "medium": dict(B=50000, d=2000, M=600),
         "gpu": dict(B=50000, d=2000, M=600)}
CLAMP_S = 0.04
# modular_power_mlp (Shi 2024, Ch. 4): B tuples of k inputs mod p, m = 2^(2k-2)(p-1) neurons, power k; tiny = a CPU
# size, medium / gpu = Fig. 4.1's (k, p) = (4, 47) and C.3's (5, 23) at the chapter's batch 1024
MODPOW = {"smoke": [dict(B=16, k=3, p=7, m=24)], "tiny": [dict(B=1024, k=3, p=23, m=352)],
          "medium": [dict(B=1024, k=4, p=47, m=2944)], "gpu": [dict(B=1024, k=4, p=47, m=2944),
                                                            dict(B=1024, k=5, p=23, m=5632)]}
# looped_linear_attention (Shi 2024, Ch. 8): B prompts of n examples in d dimensions (D = d + 1), T loops; tiny = the
# CPU size of the module's timing, medium / gpu = the chapter's largest d and n, gpu with ~4096 prompts and 200 loops
LOOPED = {"smoke": [dict(B=9, d=3, n=8, T=5)], "tiny": [dict(B=64, d=4, n=32, T=20)],
          "medium": [dict(B=1024, d=20, n=128, T=100)],
          "gpu": [dict(B=4096, d=4, n=16, T=200), dict(B=4096, d=20, n=128, T=200)]}
# token_selection (Shi 2024, Ch. 9, GemFilter): one prompt's last query row over N keys, LLaMA 3.1 8B's heads (H = 32,
# H_kv = 8, Dh = 128), k kept; smoke: the tests' odd GQA sizes; gpu: 16k and the models' 128k context
GEM = {"smoke": [dict(B=1, H=6, Hkv=2, N=37, D=24, k=5)], "tiny": [dict(B=1, H=32, Hkv=8, N=4096, D=128, k=256)],
       "medium": [dict(B=1, H=32, Hkv=8, N=32768, D=128, k=1024)],
       "gpu": [dict(B=1, H=32, Hkv=8, N=16384, D=128, k=1024), dict(B=1, H=32, Hkv=8, N=131072, D=128, k=4096)]}
GEM_POOL = 5
OPS = tuple(op.bench for op in REGISTRY)  # featlearn/kernels/registry.py
COMPILED_AT_GPU = ("patch_activation_sum", "soft_threshold", "masked_attention fwd+bwd")
"""The cases that keep a torch.compile variant at ``--size gpu`` (the compile budget, see the docstring)."""


def _gen(seed: int, device: torch.device = torch.device("cpu")) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(g, *shape, dtype, device, scale=1.0):
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64, device=g.device)).to(device, dtype)


def _grads(loss: torch.Tensor, wrt: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, wrt)


def _at(precision: str, run):
    """``run`` with PyTorch's CUDA GEMMs at ``precision`` (IEEE: TF32 off, whatever the global flag says)."""
    def call(inp):
        with cublas_precision(precision):
            return run(inp)
    return call


def _variants(eager, forward, featlearn, device: torch.device, compiled: bool = True, dots: bool = True) -> list[Variant]:
    """eager, torch.compile(eager) (``compiled``), the op's torch backend and, on CUDA, its Triton backend;
    on CUDA with ``dots`` the TF32 variants too, and every CUDA variant at an explicit precision."""
    if device.type != "cuda":
        return [Variant(EAGER, eager), *([Variant(COMPILED, _compiled(eager, forward))] if compiled else []),
                Variant("featlearn torch", functools.partial(featlearn, backend="torch"))]
    tf32 = dict(precision="tf32", tolerance=TF32_TOLERANCE)
    out = [Variant(EAGER, _at("ieee", eager))]
    out += [Variant("eager tf32", _at("tf32", eager), **tf32)] if dots else []
    out += [Variant(COMPILED, _at("ieee", _compiled(eager, forward)))] if compiled else []
    out.append(Variant("featlearn torch", _at("ieee", functools.partial(featlearn, backend="torch"))))
    if not dots:
        return out + [Variant("featlearn triton", functools.partial(featlearn, backend="triton"))]
    return out + [Variant("featlearn triton", functools.partial(featlearn, backend="triton", precision="ieee")),
                  Variant("featlearn triton tf32", functools.partial(featlearn, backend="triton", precision="tf32"),
                          **tf32)]


def _compile(size: str, case: str) -> bool:
    return size != "gpu" or case in COMPILED_AT_GPU


def _compiled(run, forward):
    """``run`` with its ``forward`` under torch.compile (AOTAutograd compiles the backward with it)."""
    return functools.partial(run, forward=torch.compile(forward, dynamic=False))


# ------------------------------------------------------------------------------------------------
def _srelu(a: torch.Tensor) -> torch.Tensor:
    return smoothed_relu(a, Q, RHO)


def _patch_eager_forward(x, w, mask):
    """One GEMM: A = x w^T; student, squares and the teacher (no grad) all from the same A."""
    a = x @ w.T
    y = _srelu(a)
    my = mask.unsqueeze(-1) * y
    with torch.no_grad():
        teacher = _srelu(TAU * a).sum(1)
    return my.sum(1), teacher, (my * y).sum(1)


def _patch_loss_and_grad(s, t, q, w, gs, gq):
    return s.detach(), t, q.detach(), *_grads((s * gs).sum() + (q * gq).sum(), [w])


def patch_eager(inp, forward=_patch_eager_forward):
    s, t, q = forward(inp["x"], inp["w"], inp["mask"])
    return _patch_loss_and_grad(s, t, q, inp["w"], inp["gs"], inp["gq"])


def patch_featlearn(inp, backend, precision="ieee"):
    s, t, q = patch_activation_sum(inp["x"], inp["w"], Activation("srelu", q=Q, rho=RHO), mask=inp["mask"],
                                   teacher_scale=TAU, squares=True, backend=backend, input_precision=precision)
    return _patch_loss_and_grad(s, t, q, inp["w"], inp["gs"], inp["gq"])


def patch_reference(inp):
    s, t, q = patch_activation_sum_reference(inp["x"], inp["w"], Activation("srelu", q=Q, rho=RHO),
                                             mask=inp["mask"], teacher_scale=TAU, squares=True)
    return _patch_loss_and_grad(s, t, q, inp["w"], inp["gs"], inp["gq"])


def patch_case(size: str, device: torch.device) -> Case:
    B, P, d, R = (PATCH[size][k] for k in "BPdR")

    def inputs(dtype, dev, seed):
        g = _gen(seed, dev)
        return {"x": _randn(g, B, P, d, dtype=dtype, device=dev),  # the data: no gradient
                "w": _randn(g, R, d, dtype=dtype, device=dev, scale=0.5 / d ** 0.5).requires_grad_(True),
                "mask": (torch.rand(B, P, generator=g, device=dev) < 0.5).to(dev, dtype),
                "gs": _randn(g, B, R, dtype=dtype, device=dev), "gq": _randn(g, B, R, dtype=dtype, device=dev)}

    # model FLOPs: the forward GEMM A = x w^T (teacher and squares read the same A) and dW = dA^T x;
    # bytes: x, w, mask, g_s, g_q read, the three sums and dW written (docs/performance.md)
    return Case("patch_activation_sum", f"B={B} P={P} d={d} R={R}",
                _variants(patch_eager, _patch_eager_forward, patch_featlearn, device,
                          _compile(size, "patch_activation_sum")),
                inputs, patch_reference, flops=4 * B * P * d * R, bytes=4 * (B * P * d + 2 * R * d + B * P + 5 * B * R))


# ------------------------------------------------------------------------------------------------
def _soft_eager_forward(x, w, b):
    return soft_threshold_reference(x, w, b)


def soft_eager(inp, forward=_soft_eager_forward):
    h = forward(inp["x"], inp["w"], inp["b"])
    return h.detach(), *_grads((h * inp["g"]).sum(), [inp["w"]])


def soft_featlearn(inp, backend, precision="ieee"):
    h = soft_threshold_layer(inp["x"], inp["w"], inp["b"], backend=backend, input_precision=precision)
    return h.detach(), *_grads((h * inp["g"]).sum(), [inp["w"]])


def soft_case(size: str, device: torch.device) -> Case:
    B, d1, m = (SOFT[size][k] for k in ("B", "d1", "m"))

    def inputs(dtype, dev, seed):
        g = _gen(seed, dev)
        inp = {"x": _randn(g, B, d1, dtype=dtype, device=dev),  # data and the scheduled bias: no gradient
               "w": _randn(g, m, d1, dtype=dtype, device=dev, scale=d1 ** -0.5).requires_grad_(True),
               "b": (0.3 * torch.rand(m, generator=g, dtype=torch.float64, device=dev)).to(dev, dtype),
               "g": _randn(g, B, m, dtype=dtype, device=dev)}
        # the slope jumps at |u| = b: no upstream gradient where rounding could put u on either side
        u = inp["x"].double() @ inp["w"].detach().double().T
        inp["g"] = away_from_kinks(inp["g"], u, inp["b"].double(), -inp["b"].double())
        return inp

    # forward GEMM x W^T and grad_W = G^T x (no grad_x: the data); x, W, b, G read, h and grad_W written
    return Case("soft_threshold", f"B={B} d1={d1} m={m}",
                _variants(soft_eager, _soft_eager_forward, soft_featlearn, device, _compile(size, "soft_threshold")),
                inputs, soft_eager, flops=4 * B * d1 * m, bytes=4 * (B * d1 + 2 * m * d1 + m + 2 * B * m))


# ------------------------------------------------------------------------------------------------
def _bn_eager_forward(p, z):
    return bn_cosine_loss_reference(p, z)


def bn_eager(inp, forward=_bn_eager_forward):
    loss = forward(inp["p"], inp["z"])
    return loss.detach(), *_grads(loss, [inp["p"]])


def bn_featlearn(inp, backend):
    loss = bn_cosine_loss(inp["p"], inp["z"], backend=backend)
    return loss.detach(), *_grads(loss, [inp["p"]])


def bn_cases(size: str, device: torch.device) -> list[Case]:
    cases = []
    for shape in BN[size]:
        N, m, dtype = shape["N"], shape["m"], shape.get("dtype", torch.float32)

        def inputs(dtype, dev, seed, N=N, m=m):
            g = _gen(seed, dev)
            p = _randn(g, N, m, dtype=dtype, device=dev)
            z = 0.5 * p + _randn(g, N, m, dtype=dtype, device=dev)  # the stop-gradient target
            return {"p": p.requires_grad_(True), "z": z}

        # no GEMM (FLOPs negligible); p and z read, dp written
        cases.append(Case("bn_cosine_loss", f"N={N} m={m}" + (", float64" if dtype == torch.float64 else ""),
                          _variants(bn_eager, _bn_eager_forward, bn_featlearn, device, _compile(size, "bn_cosine_loss"),
                                    dots=False), inputs, bn_eager, dtype=dtype, bytes=3 * N * m * dtype.itemsize))
    return cases


# ------------------------------------------------------------------------------------------------
def _infonce_eager_forward(ha, hq, hn, tau):
    return infonce_reference(ha, hq, hn, tau).mean()


def infonce_eager(inp, forward=_infonce_eager_forward):
    loss = forward(inp["ha"], inp["hq"], inp["hn"], inp["tau"])
    return loss.detach(), *_grads(loss, [inp["ha"]])


def infonce_featlearn(inp, backend):
    """The streamed loss has one backend (PyTorch, any device): ``backend`` only names the variant."""
    loss = infonce_stopgrad(inp["ha"], inp["hq"], inp["hn"], inp["tau"])[0].mean()
    return loss.detach(), *_grads(loss, [inp["ha"]])


def infonce_case(size: str, device: torch.device) -> Case:
    K, N, m = (INFONCE[size][k] for k in "KNm")

    def inputs(dtype, dev, seed):
        g = _gen(seed, dev)
        s = m ** -0.5
        return {"ha": _randn(g, K, m, dtype=dtype, device=dev, scale=s).requires_grad_(True),
                "hq": _randn(g, K, m, dtype=dtype, device=dev, scale=s),
                "hn": _randn(g, N, m, dtype=dtype, device=dev, scale=s), "tau": 3.5}

    torch_variant = functools.partial(infonce_featlearn, backend="torch")
    variants = [Variant(EAGER, infonce_eager),
                *([Variant(COMPILED, _compiled(infonce_eager, _infonce_eager_forward))]
                  if _compile(size, "infonce_stopgrad") else []),
                Variant("featlearn torch", torch_variant)]
    if device.type == "cuda":  # one backend, on cuBLAS: IEEE and TF32 of the eager loss and of the streamed one
        tf32 = dict(precision="tf32", tolerance=TF32_TOLERANCE)
        variants = [Variant(v.name, _at("ieee", v.run)) for v in variants] + [
            Variant("eager tf32", _at("tf32", infonce_eager), **tf32),
            Variant("featlearn torch tf32", _at("tf32", torch_variant), **tf32)]
    # similarities (2 K N m) and the weighted sum of negatives in grad h_a (2 K N m); h_a, h_q, h_n read,
    # grad h_a written
    return Case("infonce_stopgrad", f"K={K} N={N} m={m}", variants, inputs, infonce_eager,
                flops=4 * K * N * m, bytes=4 * (3 * K * m + N * m))


# ------------------------------------------------------------------------------------------------
def _attn_eager_forward(rows, idx, keys, values):
    """What a user writes: gather the masked queries' rows, GEMM, softmax, GEMM."""
    return torch.softmax(rows[idx] @ keys.transpose(1, 2), dim=-1) @ values


def _attn_sdpa_forward(rows, idx, keys, values):
    """SDPA's math backend with the same semantics: per-sample queries expanded from the shared rows, scale 1."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(rows[idx], keys, values, scale=1.0)


def _attn_outputs(out, inp, backward):
    return (out.detach(), *_grads((out * inp["g"]).sum(), [inp["rows"]])) if backward else (out.detach(),)


def attn_eager(inp, backward, forward=_attn_eager_forward):
    return _attn_outputs(forward(inp["rows"], inp["idx"], inp["keys"], inp["values"]), inp, backward)


def _attn_sdpa_auto_forward(rows, idx, keys, values):
    """SDPA with PyTorch's own kernel choice (a fused kernel where one takes float32 at this head size, else
    math), as a user on CUDA would call it: one head, scale 1."""
    out = torch.nn.functional.scaled_dot_product_attention(rows[idx].unsqueeze(1), keys.unsqueeze(1),
                                                           values.unsqueeze(1), scale=1.0)
    return out.squeeze(1)


def attn_featlearn(inp, backward, backend, precision="ieee"):
    out, _ = masked_attention(inp["rows"], inp["keys"], inp["values"], inp["idx"], backend=backend,
                              input_precision=precision)
    return _attn_outputs(out, inp, backward)


def attn_cases(size: str, device: torch.device) -> list[Case]:
    """Forward, and forward + backward (the gradient of the shared rows: the data needs none), per shape."""
    cases = []
    for shape in ATTN[size]:
        B, P, Pq, d = (shape[k] for k in ("B", "P", "Pq", "d"))

        def inputs(dtype, dev, seed, B=B, P=P, Pq=Pq, d=d):
            g = _gen(seed, dev)
            return {"rows": _randn(g, P, d, dtype=dtype, device=dev, scale=2 * d ** -0.5).requires_grad_(True),
                    "idx": torch.rand(B, P, generator=g, device=dev).argsort(1)[:, :Pq],  # the masked positions
                    "keys": _randn(g, B, P, d, dtype=dtype, device=dev),
                    "values": _randn(g, B, P, d, dtype=dtype, device=dev),
                    "g": _randn(g, B, Pq, d, dtype=dtype, device=dev)}

        # model FLOPs: the forward's two GEMMs, the backward's two (dO V^T, dS K); the fused backward also
        # recomputes S (+2 B Pq P d), not counted
        gflop = 4 * B * Pq * P * d / 1e9
        # bytes: keys, values, the rows and the index read, the output written; backward: dO read, d rows written
        fwd_bytes = 4 * (2 * B * P * d + P * d + B * Pq * d) + 8 * B * Pq
        for backward, what in ((False, f"fwd {gflop:.3g} GFLOP"), (True, f"fwd+bwd {2 * gflop:.3g} GFLOP")):
            eager = functools.partial(attn_eager, backward=backward)
            compiled = _compile(size, "masked_attention " + ("fwd+bwd" if backward else "fwd"))
            variants = _variants(eager, _attn_eager_forward, functools.partial(attn_featlearn, backward=backward),
                                 device, compiled)
            variants.append(Variant("sdpa math", functools.partial(attn_eager, backward=backward,
                                                                   forward=_attn_sdpa_forward)))
            if device.type == "cuda":
                variants.append(Variant("sdpa", _at("ieee", functools.partial(attn_eager, backward=backward,
                                                                              forward=_attn_sdpa_auto_forward))))
            cases.append(Case("masked_attention", f"B={B} P={P} Pq={Pq} d={d}, {what}", variants, inputs, eager,
                              flops=gflop * 1e9 * (2 if backward else 1),
                              bytes=fwd_bytes + (4 * (B * Pq * d + P * d) if backward else 0)))
    return cases


# ------------------------------------------------------------------------------------------------
def _clamp_eager_forward(x, w, b):
    return smoothed_clamp_reference(x, w, b, CLAMP_S)


def clamp_eager(inp, forward=_clamp_eager_forward):
    h = forward(inp["x"], inp["w"], inp["b"])
    return h.detach(), *_grads((h * inp["g"]).sum(), [inp["w"], inp["b"]])


def clamp_featlearn(inp, backend, precision="ieee"):
    h = smoothed_clamp_layer(inp["x"], inp["w"], inp["b"], CLAMP_S, backend=backend, input_precision=precision)
    return h.detach(), *_grads((h * inp["g"]).sum(), [inp["w"], inp["b"]])


def clamp_case(size: str, device: torch.device) -> Case:
    B, d, M = (CLAMP[size][k] for k in ("B", "d", "M"))

    def inputs(dtype, dev, seed):
        g = _gen(seed, dev)  # unit-variance inputs and w ~ N(0, 1/d): pre-activations O(1), across the ramp [0, 1]
        return {"x": _randn(g, B, d, dtype=dtype, device=dev),
                "w": _randn(g, M, d, dtype=dtype, device=dev, scale=d ** -0.5).requires_grad_(True),
                "b": _randn(g, M, dtype=dtype, device=dev, scale=0.5).requires_grad_(True),
                "g": _randn(g, B, M, dtype=dtype, device=dev)}

    # forward GEMM and grad_W; x, w, b, G read, h, grad_w, grad_b written
    return Case("smoothed_clamp", f"B={B} d={d} M={M} s={CLAMP_S}",
                _variants(clamp_eager, _clamp_eager_forward, clamp_featlearn, device, _compile(size, "smoothed_clamp")),
                inputs, clamp_eager, flops=4 * B * d * M, bytes=4 * (B * d + 2 * M * d + 2 * M + 2 * B * M))


# ------------------------------------------------------------------------------------------------
def modpow_eager(inp, forward=modular_power_mlp_reference):
    out = forward(inp["a"], inp["U"], inp["W"], inp["a"].shape[1])
    return out.detach(), *_grads((out * inp["g"]).sum(), [inp["U"], inp["W"]])


def modpow_featlearn(inp, backend, precision="ieee"):
    out = modular_power_mlp(inp["a"], inp["U"], inp["W"], inp["a"].shape[1], backend=backend, input_precision=precision)
    return out.detach(), *_grads((out * inp["g"]).sum(), [inp["U"], inp["W"]])


def modpow_cases(size: str, device: torch.device) -> list[Case]:
    cases = []
    for shape in MODPOW[size]:
        B, k, p, m = (shape[key] for key in ("B", "k", "p", "m"))

        def inputs(dtype, dev, seed, B=B, k=k, p=p, m=m):
            g = _gen(seed, dev)  # sums of k embeddings ~ N(0, k/m^(2/k)): the power keeps the logits O(1)
            scale = m ** (-1.0 / k) / k ** 0.5
            return {"a": torch.randint(0, p, (B, k), generator=g, device=g.device).to(dev),
                    "U": _randn(g, k, p, m, dtype=dtype, device=dev, scale=scale).requires_grad_(True),
                    "W": _randn(g, m, p, dtype=dtype, device=dev).requires_grad_(True),
                    "g": _randn(g, B, p, dtype=dtype, device=dev)}

        # the forward GEMM and the two backward ones (G W^T, (S^k)^T G); U, W, G read, logits, dU, dW written
        cases.append(Case("modular_power_mlp", f"B={B} k={k} p={p} m={m}",
                          _variants(modpow_eager, modular_power_mlp_reference, modpow_featlearn, device,
                                    _compile(size, "modular_power_mlp")),
                          inputs, modpow_eager, flops=6 * B * m * p,
                          bytes=4 * (2 * k * p * m + 2 * m * p + 2 * B * p) + 8 * B * k))
    return cases


# ------------------------------------------------------------------------------------------------
def _looped_outputs(Z, inp):
    return Z.detach(), *_grads((Z * inp["g"]).sum(), [inp["Q"], inp["P"], inp["eta"]])


def looped_eager(inp, forward=looped_linear_attention_reference):
    """The loop a user writes (a batched GEMM per loop), every loop's row kept; gradients of Q, P and eta."""
    return _looped_outputs(forward(inp["G"], inp["z0"], inp["Q"], inp["P"], inp["eta"]), inp)


def looped_featlearn(inp, backend):
    return _looped_outputs(looped_linear_attention(inp["G"], inp["z0"], inp["Q"], inp["P"], inp["eta"],
                                                   backend=backend), inp)


def looped_cases(size: str, device: torch.device) -> list[Case]:
    cases = []
    for shape in LOOPED[size]:
        B, d, n, T = (shape[key] for key in ("B", "d", "n", "T"))
        D = d + 1

        def inputs(dtype, dev, seed, B=B, D=D, n=n, T=T):
            g = _gen(seed, dev)  # the module's prompts: z0 = [0, alpha]; weights near the construction, steps that
            E = _randn(g, B, n, D, dtype=torch.float64, device=dev)  # keep every loop a contraction
            G = E.mT @ E
            eye = torch.eye(D, dtype=torch.float64, device=dev)
            weights = [(eye + _randn(g, D, D, dtype=torch.float64, device=dev, scale=0.1)) for _ in range(2)]
            z0 = torch.zeros(B, D, dtype=torch.float64, device=dev)
            z0[:, -1] = 1.0
            eta = 0.5 / torch.linalg.eigvalsh(G).amax() * (0.5 + torch.rand(T, generator=g, dtype=torch.float64,
                                                                             device=g.device).to(dev))
            return {"G": G.to(dtype), "z0": z0.to(dtype), "Q": weights[0].to(dtype).requires_grad_(True),
                    "P": weights[1].to(dtype).requires_grad_(True), "eta": eta.to(dtype).requires_grad_(True),
                    "g": _randn(g, B, T + 1, D, dtype=dtype, device=dev)}

        # FLOPs a prompt needs (docs/performance.md): Q G P twice (forward, backward) 8 D^3, the loops 2 T D^2 and
        # the adjoint's three products 6 T D^2, dQ and dP 4 D^3; no dot for tensor cores (D <= 64, a U per prompt):
        # the FMA units, so the case carries no TF32 variant. Bytes: G read, Z written, dL/dZ read (float32).
        gflop = B * (12 * D ** 3 + 8 * T * D ** 2) / 1e9
        cases.append(Case("looped_linear_attention", f"B={B} d={d} n={n} T={T}, {gflop:.3g} GFLOP",
                          _variants(looped_eager, looped_linear_attention_reference, looped_featlearn, device,
                                    _compile(size, "looped_linear_attention"), dots=False),
                          inputs, looped_eager, bytes=4 * (B * D * D + 2 * B * (T + 1) * D + 3 * D * D + 2 * T)))
    return cases


# ------------------------------------------------------------------------------------------------
def _gem_outputs(scores, idx):
    """The pooled scores and the selected tokens' scores, largest first: equal to the reference's top-k values
    whatever order ties take (the ids themselves are checked by tests/test_token_selection.py)."""
    return scores, scores.gather(-1, idx).sort(dim=-1, descending=True).values


def _gem_eager_forward(q, keys, k):
    K = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)  # repeat_kv
    s = torch.matmul(q.unsqueeze(2), K.transpose(2, 3))[:, :, 0].sum(1, keepdim=True)
    s = torch.nn.functional.avg_pool1d(s, GEM_POOL, stride=1, padding=GEM_POOL // 2)[:, 0]
    return s, torch.sort(torch.topk(s, k, dim=-1).indices, dim=-1).values


def gem_eager(inp, forward=_gem_eager_forward):
    """The reference repo's code: K repeated per query head, the last row's products, head sum, pool, top-k, sort."""
    return _gem_outputs(*forward(inp["q"], inp["keys"], inp["k"]))


def gem_featlearn(inp, backend):
    """select_tokens, split at its seam so the scores come out too: selection_scores, then sorted_top_k."""
    s = selection_scores(inp["q"], inp["keys"], GEM_POOL, backend=backend)
    return _gem_outputs(s, sorted_top_k(s, inp["k"]))


def gem_cases(size: str, device: torch.device) -> list[Case]:
    cases = []
    for shape in GEM[size]:
        B, H, Hkv, N, D, k = (shape[key] for key in ("B", "H", "Hkv", "N", "D", "k"))

        def inputs(dtype, dev, seed, B=B, H=H, Hkv=Hkv, N=N, D=D, k=k):
            g = _gen(seed, dev)
            return {"q": _randn(g, B, H, D, dtype=dtype, device=dev),
                    "keys": _randn(g, B, Hkv, N, D, dtype=dtype, device=dev), "k": k}

        # memory-bound: K read once (B H_kv N Dh), the query rows, the scores written; no dot for tensor cores
        # (a matrix-vector product), so no TF32 variant and no FLOP count
        cases.append(Case("token_selection", f"B={B} H={H} H_kv={Hkv} N={N} Dh={D} k={k}",
                          _variants(gem_eager, _gem_eager_forward, gem_featlearn, device,
                                    _compile(size, "token_selection"), dots=False),
                          inputs, gem_eager, bytes=4 * (B * Hkv * N * D + B * H * D + B * N) + 8 * B * k))
    return cases


def cases(ops: list[str], size: str, device: torch.device) -> list[Case]:
    """The cases of ``ops`` at ``size``, in the order of ``ops``."""
    build = {"patch_activation_sum": lambda: [patch_case(size, device)],
             "soft_threshold": lambda: [soft_case(size, device)],
             "bn_cosine_loss": lambda: bn_cases(size, device),
             "infonce_stopgrad": lambda: [infonce_case(size, device)],
             "masked_attention": lambda: attn_cases(size, device),
             "smoothed_clamp": lambda: [clamp_case(size, device)],
             "modular_power_mlp": lambda: modpow_cases(size, device),
             "looped_linear_attention": lambda: looped_cases(size, device),
             "token_selection": lambda: gem_cases(size, device)}
    return [case for op in ops for case in build[op]()]
