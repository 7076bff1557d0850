"""The calls ``featlearn gpu compile`` builds: each op of ``featlearn.kernels`` through its Triton path at
the sizes its methods run (their configs), on ``meta`` tensors (nothing is allocated or computed), in the precisions its
methods use. A new op or kernel adds its calls here; ``tests/test_gpu_compile.py`` fails while a launched
kernel has none.

Example:
    >>> sorted(cases())
    ['bn_cosine_loss', 'looped_linear_attention', 'masked_attention', 'modular_power_mlp', 'patch_activation_sum', 'smoothed_clamp', 'soft_threshold', 'token_selection']
    >>> cases()["soft_threshold"][0][0]
    'contrastive-medium/fp32-ieee'
"""
from __future__ import annotations

import collections

PRECISIONS = (("fp32-ieee", "float32", "ieee"), ("fp32-tf32", "float32", "tf32"), ("fp64", "float64", "ieee"))


def _t(*shape, dtype="float32", grad=False):
    import torch

    return torch.empty(*shape, device="meta", dtype=getattr(torch, dtype), requires_grad=grad)


def _patch_sum(B, P, D, R, kind, q, dtype, precision, mask=False, teacher=False, squares=False):
    from featlearn.kernels import Activation, patch_activation_sum

    x, w = _t(B, P, D, dtype=dtype), _t(R, D, dtype=dtype, grad=True)
    out = patch_activation_sum(x, w, Activation(kind, q=q, rho=0.5), mask=_t(B, P, dtype=dtype) if mask else None,
                               teacher_scale=1.5 if teacher else None, squares=squares, backend="triton",
                               input_precision=precision)
    (out.student.sum() + (out.squares.sum() if squares else 0)).backward()


def _layer(op, B, D, M, dtype, precision, grad_x=False):
    import featlearn.kernels as k

    x, w, b = _t(B, D, dtype=dtype, grad=grad_x), _t(M, D, dtype=dtype, grad=True), _t(M, dtype=dtype, grad=True)
    if op == "soft_threshold":
        h = k.soft_threshold_layer(x, w, b, backend="triton", input_precision=precision)
    else:
        h = k.smoothed_clamp_layer(x, w, b, 0.1, backend="triton", input_precision=precision)
    h.sum().backward()


def _attention(B, P, PQ, R, D, dtype, precision, shared=True, pad=False, groups=0):
    import torch
    from featlearn.kernels import masked_attention

    queries = _t(R, D, dtype=dtype, grad=True) if shared else _t(B, PQ, D, dtype=dtype, grad=True)
    index = torch.empty(B, PQ, dtype=torch.long, device="meta") if shared else None
    out, _ = masked_attention(queries, _t(B, P, D, dtype=dtype), _t(B, P, D, dtype=dtype), index,
                              key_padding_mask=torch.empty(B, P, dtype=torch.bool, device="meta") if pad else None,
                              key_groups=torch.empty(B, P, dtype=torch.long, device="meta") if groups else None,
                              n_groups=groups, backend="triton", input_precision=precision, check_values=False)
    out.sum().backward()


def _bn_cosine(N, M, dtype, out_norm, stop_grad=True):
    from featlearn.kernels import bn_cosine_loss

    bn_cosine_loss(_t(N, M, dtype=dtype, grad=True), _t(N, M, dtype=dtype, grad=not stop_grad), out_norm=out_norm,
                   eps=1e-6, sync=False, backend="triton").backward()


def _modpow(B, k, p, m, dtype, precision):
    import torch
    from featlearn.kernels import modular_power_mlp

    a = torch.empty(B, k, dtype=torch.long, device="meta")
    modular_power_mlp(a, _t(k, p, m, dtype=dtype, grad=True), _t(m, p, dtype=dtype, grad=True), k, backend="triton",
                      input_precision=precision).sum().backward()


def _looped(B, D, T, dtype):
    from featlearn.kernels import looped_linear_attention

    looped_linear_attention(_t(B, D, D, dtype=dtype), _t(B, D, dtype=dtype), _t(D, D, dtype=dtype, grad=True),
                            _t(D, D, dtype=dtype, grad=True), _t(T, dtype=dtype, grad=True),
                            backend="triton").sum().backward()


def _token_sel(B, H, HKV, N, D, dtype):
    from featlearn.kernels import selection_scores

    selection_scores(_t(B, H, D, dtype=dtype), _t(B, HKV, N, D, dtype=dtype), backend="triton")


def cases() -> dict:
    """op -> [(case name, call)]: sizes from the methods' configs. Each kernel is built in every
    precision at its method's main size, and in the precisions its methods run at the other sizes (a size
    divisible by 16 or not, a flag on or off, compiles different code)."""
    from functools import partial as p

    cases = collections.defaultdict(list)
    every = PRECISIONS
    ieee_and_fp64 = [v for v in PRECISIONS if v[0] != "fp32-tf32"]
    for name, dtype, precision in every:
        # MRP medium (k=64, m=8: R=512, d=1024, P=32, full batch 16384) with teacher and squares
        # (A saved: 1 GiB in float32); contrastive medium (d1=2048, m=1024, K+N=5120 rows); dissertation ch. 2
        # Table A.1 (d=500, 2m=1000); ViT MAE at P = 1024 (B=64, P=1024 keys, 768 masked queries from 1024
        # shared rows, d=1152, 130 areas) and its contrastive path (per-sample queries, P=256, d=256); the
        # x-gradient kernels at unaligned sizes (the contrastive ablation, ch. 2's Gaussian mixture: d=100, 800 neurons)
        cases["patch_activation_sum"].append(
            (f"mrp-medium/{name}", p(_patch_sum, 16384, 32, 1024, 512, "srelu", 3, dtype, precision, teacher=True,
                                     squares=True)))
        cases["soft_threshold"] += [
            (f"contrastive-medium/{name}", p(_layer, "soft_threshold", 5120, 2048, 1024, dtype, precision)),
            (f"unaligned-grad-x/{name}", p(_layer, "soft_threshold", 1000, 500, 30, dtype, precision, grad_x=True))]
        cases["smoothed_clamp"] += [
            (f"ch2-parity/{name}", p(_layer, "smoothed_clamp", 4000, 500, 1000, dtype, precision)),
            (f"ch2-mog-grad-x/{name}", p(_layer, "smoothed_clamp", 4096, 100, 800, dtype, precision, grad_x=True))]
        cases["masked_attention"] += [
            (f"vit-mae/{name}", p(_attention, 64, 1024, 768, 1024, 1152, dtype, precision, groups=130)),
            (f"vit-cl/{name}", p(_attention, 64, 256, 256, 0, 256, dtype, precision, shared=False, groups=17))]
        # dissertation ch. 4: the MLP at the paper's (k, p) with m = 2^(2k-2)(p-1), batch 1024: 47 and 23 classes
        # (class tiles of 64 and 32, unaligned) and 97 (a 128-wide class tile)
        cases["modular_power_mlp"] += [
            (f"ch4-k4-p47/{name}", p(_modpow, 1024, 4, 47, 2944, dtype, precision)),
            (f"ch4-k3-p97/{name}", p(_modpow, 1024, 3, 97, 1536, dtype, precision)),
            (f"ch4-k5-p23/{name}", p(_modpow, 1024, 5, 23, 5632, dtype, precision))]
    for name, dtype, precision in ieee_and_fp64:
        # MRP at k = 512, m = 22 (A recomputed in the backward); the non-contrastive encoder (R=2, d=1000, mask,
        # float64); unaligned sizes (d=500, R=30, P=30); padded keys
        cases["patch_activation_sum"] += [
            (f"mrp-large/{name}", p(_patch_sum, 4096, 64, 2048, 11264, "srelu", 3, dtype, precision)),
            (f"noncontrastive-encoder/{name}", p(_patch_sum, 8192, 32, 1000, 2, "pow", 3, dtype, precision, mask=True,
                                      teacher=True)),
            (f"unaligned/{name}", p(_patch_sum, 1000, 30, 500, 30, "relu", 1, dtype, precision, squares=True))]
        cases["masked_attention"].append(
            (f"vit-mae-exclude/{name}", p(_attention, 64, 1024, 768, 1024, 1152, dtype, precision, pad=True)))
    for dtype, label in (("float64", "fp64"), ("float32", "fp32")):
        # non-contrastive: N=8192, m=2 in float64 (its configs), a wider m=64 in float32; both normalisations
        cases["bn_cosine_loss"] += [(f"noncontrastive-bn/{label}", p(_bn_cosine, 8192, 2, dtype, "bn")),
                                    (f"noncontrastive-l2/{label}", p(_bn_cosine, 8192, 2, dtype, "l2")),
                                    (f"wide-bn-no-stopgrad/{label}", p(_bn_cosine, 8192, 64, dtype, "bn", False)),
                                    (f"wide-l2-no-stopgrad/{label}", p(_bn_cosine, 8193, 64, dtype, "l2", False))]
        # dissertation ch. 8: 4096 prompts at d = 4, 15 and 20 (D = d + 1: U tiles of 8, 16 and 32; D = 16 aligned) over
        # T = 200 loops, and the largest D the Triton path takes (64: one prompt per program)
        cases["looped_linear_attention"] += [(f"ch8-d4/{label}", p(_looped, 4096, 5, 200, dtype)),
                                             (f"ch8-d15/{label}", p(_looped, 4096, 16, 200, dtype)),
                                             (f"ch8-d20/{label}", p(_looped, 4096, 21, 200, dtype)),
                                             (f"max-dim/{label}", p(_looped, 1024, 64, 10, dtype))]
    for dtype, label in (("bfloat16", "bf16"), ("float32", "fp32"), ("float64", "fp64")):
        # dissertation ch. 9 (GemFilter): LLaMA 3.1 8B / Mistral Nemo (H = 32, H_kv = 8, Dh = 128) and Phi 3.5 Mini
        # (32, 32, 96) at 128k tokens, a prompt length not a multiple of 16, and a small synthetic decoder (Dh = 24:
        # rows not 16-aligned); bf16: the models' own keys
        cases["token_selection"] += [(f"llama31-8b-128k/{label}", p(_token_sel, 1, 32, 8, 131072, 128, dtype)),
                                     (f"phi35-mini-128k/{label}", p(_token_sel, 1, 32, 32, 131072, 96, dtype)),
                                     (f"unaligned-n/{label}", p(_token_sel, 1, 32, 8, 100003, 128, dtype)),
                                     (f"small-decoder/{label}", p(_token_sel, 4, 8, 2, 4099, 24, dtype))]
    return dict(cases)
