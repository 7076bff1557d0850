"""Every op of ``featlearn.kernels`` with a Triton path, through ``backend="triton"``, against its float64
reference: soft_threshold_layer, smoothed_clamp_layer (s > 0, and s = 0: the truncated ReLU, another
compiled epilogue), patch_activation_sum, masked_attention, bn_cosine_loss (bn, with bn_column_stats; l2),
modular_power_mlp, looped_linear_attention, token_selection (selection_scores and select_tokens: no gradients).
``infonce`` (infonce_stopgrad, infonce_grad_closed_form) has no Triton path, only PyTorch: nothing to compile.

A case: fresh random inputs (seeded by the test id) rounded to the run's dtype; the op with every output
buffer poisoned with NaN (``poisoned``: an unwritten cell is a NaN); the ``*_reference`` in float64 on the
same rounded inputs, on the device (CUDA) or the CPU (dry mode); forward outputs and every gradient compared
by ||out - ref|| / ||ref||. A NaN or inf anywhere fails. ``pytest -rP`` prints the measured errors.

Sizes: odd (tile-straddling), medium, large, and int32, where an index product (B*D, B*P*d, N*m) passes
2^31 elements (float32 only: 12-26 GB). The int32 input is k copies of a fresh random block stacked along
the batch dim: each copy's outputs are the block's, the float64 reference runs on the block (a float64 copy
of the whole would not fit), upstream gradients are fresh per copy, a weight's gradient is the sum of the
copies' reference gradients. Options (masks, shared query rows, eps, ...) vary with the size.
"""
import inspect
import math
import zlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import featlearn.kernels as K
from featlearn.bench.harness import away_from_kinks  # upstream gradients 0 near a kink; outputs compared everywhere
from featlearn.kernels import Activation

pytestmark = pytest.mark.gpu
F64 = torch.float64

# float32 IEEE: an FMA dot adds its K terms in sequence, a relative error of ~0.3 * 2^-24 * sqrt(K)
# (simulated: 6e-7 at K = 1k, 8e-7 at 2k, 4.6e-6 at 65k, the int32 cases' batch reductions); 1e-5 bounds
# the longest with 2x margin and is still 50x under TF32 rounding, the next failure mode up.
FP32_TOL = 1e-5
# TF32 rounds each dot operand to 10 mantissa bits (2^-11 = 4.9e-4): emulated on the CPU, 2.9e-4 per product
# sum and 4.1e-4 through the attention's two; x3 through a cubic activation. 5e-3 keeps >= 5x margin while a
# wrong index or mask gives O(1e-2 .. 1).
TF32_TOL = 5e-3
# float64: ~1e-16 per operation, ~1e-14 after 65k-term sums; 1e-12 catches a float32 step (~1e-7) anywhere.
FP64_TOL = 1e-12
# id: dtype, input_precision, tolerance ("fp32": ops without dots, no input_precision)
PRECISIONS = {"fp32-ieee": (torch.float32, "ieee", FP32_TOL), "fp32-tf32": (torch.float32, "tf32", TF32_TOL),
              "fp64": (F64, "auto", FP64_TOL), "fp32": (torch.float32, None, FP32_TOL)}
STATS = ("mean_p", "mean_z", "var_p", "var_z", "cov", "rho")  # bn_column_stats: float64 whatever the inputs


@dataclass
class Op:
    """``make(shape, size, gen, dtype) -> (inputs, needs_grad, rows)`` (rows: inputs stacked along the batch);
    ``call(inputs, input_precision)``, ``ref(inputs)``: output dicts; ``upstream(inputs, gen)``: gradients of the
    differentiable outputs; ``sizes``: {size: (cuda, tiny)}, int32 as ((shape, k), (shape, k)); k times the first
    ``index_dims`` of the shape pass 2^31 at int32. ``whole``: outputs reduce over the batch (a loss)."""
    name: str
    make: Callable
    call: Callable
    ref: Callable
    upstream: Callable
    sizes: dict
    index_dims: int
    dots: bool = True
    whole: bool = False


def _randn(gen, dtype, *shape, scale=1.0, shift=0.0):
    """Fresh normal values rounded to ``dtype`` and held in float64 (the reference's exact inputs)."""
    return (torch.randn(shape, generator=gen, device=gen.device, dtype=F64) * scale + shift).to(dtype).double()


def _rand(gen, dtype, *shape, low=0.0, high=1.0):
    return (torch.rand(shape, generator=gen, device=gen.device, dtype=F64) * (high - low) + low).to(dtype).double()


def _grad_away_from(gen, u, *kinks):  # an upstream gradient, 0 near the kinks
    return away_from_kinks(torch.randn(u.shape, generator=gen, device=u.device, dtype=F64), u, *kinks)


# ---------------------------------------------------------------------------------------------------
# soft_threshold_layer and smoothed_clamp_layer: x [B, D], w [M, D], b [M] -> h [B, M]
# ---------------------------------------------------------------------------------------------------
# tiny (dry) sizes: a tile or two of the interpreter's 16 (bn: 8 x 4) per dim, each program costs ~0.05 s there
LAYER_SIZES = {"odd": ((1031, 257, 129), (7, 19, 13)), "medium": ((4096, 1024, 512), (17, 8, 5)),
               "large": ((16384, 2048, 2048), (5, 20, 18)),
               # 16 copies of 4097 rows x 32768: B*D = 2,148,007,936; x and grad_x 8.6 GB each
               "int32": (((4097, 32768, 16), 16), ((5, 7, 3), 3))}


def _layer_make(b_low, b_high, w_scale):
    def make(shape, size, gen, dtype):
        B, D, M = shape
        w = _randn(gen, dtype, M, D, scale=w_scale / D ** 0.5)  # x w^T ~ N(0, w_scale^2)
        return ({"x": _randn(gen, dtype, B, D), "w": w, "b": _rand(gen, dtype, M, low=b_low, high=b_high)},
                ("x", "w", "b"), {"x"})
    return make


def _layer_op(name, function, reference, b_range, w_scale, kinks):
    """``kinks(b)``: where the activation's slope jumps (none for s > 0)."""
    return Op(name, _layer_make(*b_range, w_scale),
              lambda i, p: {"h": function(i["x"], i["w"], i["b"], backend="triton", input_precision=p)},
              lambda i: {"h": reference(i["x"], i["w"], i["b"])},
              lambda i, gen: {"h": _grad_away_from(gen, i["x"].detach() @ i["w"].detach().T, *kinks(i["b"].detach()))},
              LAYER_SIZES, 2)


def _clamp_op(name, s):  # z = x w^T ~ N(0, 0.25) plus b in [-0.2, 0.8]: both flat parts and the ramp
    return _layer_op(name, lambda *a, **kw: K.smoothed_clamp_layer(*a, s, **kw),
                     lambda *a: K.smoothed_clamp_reference(*a, s), (-0.2, 0.8), 0.5,
                     lambda b: () if s else (-b, 1.0 - b))  # u = x w^T = z - b: kinks at z = 0 and z = 1


# ---------------------------------------------------------------------------------------------------
# patch_activation_sum: x [B, P, d], w [R, d] -> student, teacher, squares [B, R]
# ---------------------------------------------------------------------------------------------------
# per size: activation (smooth ones only: relu's kink is inside the sum over patches), mask, teacher_scale,
# squares, save_preactivation_bytes (0: the backward recomputes A)
PATCH_OPTS = {"odd": (Activation("srelu", q=3, rho=0.5), "bool", 2.0, True, None),
              "medium": (Activation("pow", q=3), "float", None, False, 0),
              "large": (Activation("srelu", q=3, rho=0.25), None, 2.0, True, None),
              "int32": (Activation("srelu", q=3, rho=0.5), "bool", 2.0, True, None)}


def _patch_make(shape, size, gen, dtype):
    B, P, d, R = shape
    act, mask_kind, ts, squares, save = PATCH_OPTS[size]
    mask = {"bool": lambda: torch.rand(B, P, generator=gen, device=gen.device) < 0.7,
            "float": lambda: _rand(gen, dtype, B, P, high=2.0), None: lambda: None}[mask_kind]()
    inputs = {"x": _randn(gen, dtype, B, P, d), "w": _randn(gen, dtype, R, d, scale=d ** -0.5), "mask": mask,
              "opts": dict(activation=act, teacher_scale=ts, squares=squares),
              "save": {} if save is None else {"save_preactivation_bytes": save}}
    return inputs, ("x", "w"), {"x", "mask"}


def _present(sums):  # the PatchSums asked for
    return {k: v for k, v in sums._asdict().items() if v is not None}


def _patch_upstream(i, gen):
    shape, names = (i["x"].shape[0], i["w"].shape[0]), ["student"] + (["squares"] if i["opts"]["squares"] else [])
    return {n: torch.randn(shape, generator=gen, device=gen.device, dtype=F64) for n in names}


# ---------------------------------------------------------------------------------------------------
# masked_attention: queries (R, d) shared or (B, Pq, d), keys (B, P, d), values (B, P, dv) -> out, group_attn
# ---------------------------------------------------------------------------------------------------
# per size: queries ("index": shared rows picked by query_index, "rows": every shared row, "sample":
# per-sample), key padding, number of key groups, values = keys (vit_cl's use; saves 8.6 GB at int32)
ATTN_OPTS = {"odd": ("index", True, 5, False), "medium": ("sample", False, 4, False),
             "large": ("rows", True, 0, False), "int32": ("index", True, 3, True)}


def _attn_make(shape, size, gen, dtype):
    B, P, d, dv, Q = shape  # Q: query rows (shared), or queries per sample
    queries, padded, n_groups, same = ATTN_OPTS[size]
    scale = d ** -0.25  # logits <q, k> ~ N(0, 1): TF32 rounding stays ~1e-3 through the softmax
    keys = _randn(gen, dtype, B, P, d, scale=scale)
    i = {"q": _randn(gen, dtype, *((B, Q, d) if queries == "sample" else (Q, d)), scale=scale), "keys": keys,
         "values": keys if same else _randn(gen, dtype, B, P, dv), "index": None, "pad": None, "groups": None,
         "n_groups": n_groups}
    if queries == "index":
        i["index"] = torch.randint(0, Q, (B, Q), generator=gen, device=gen.device)
    if padded:
        i["pad"] = torch.rand(B, P, generator=gen, device=gen.device) < 0.25
        i["pad"][:, 0] = False  # every sample keeps a key
    if n_groups:
        i["groups"] = torch.randint(0, n_groups, (B, P), generator=gen, device=gen.device)
    return i, ("q",), {"keys", "values", "index", "pad", "groups"} | ({"q"} if queries == "sample" else set())


def _attn_args(i):
    return i["q"], i["keys"], i["values"], i["index"], i["pad"], i["groups"], i["n_groups"]


def _attn_outputs(out, group_attn):
    return {"out": out, **({"group_attn": group_attn} if group_attn is not None else {})}


def _attn_upstream(i, gen):
    q = i["q"]
    pq = q.shape[1] if q.dim() == 3 else (i["index"].shape[1] if i["index"] is not None else q.shape[0])
    return {"out": torch.randn(len(i["keys"]), pq, i["values"].shape[2], generator=gen, device=gen.device, dtype=F64)}


# ---------------------------------------------------------------------------------------------------
# bn_cosine_loss (and bn_column_stats): p, z [N, m] -> scalar loss (and column statistics)
# ---------------------------------------------------------------------------------------------------
BN_SIZES = {"odd": ((1001, 37), (9, 5)), "medium": ((4096, 512), (19, 6)), "large": ((65536, 2048), (40, 3)),
            # 257 copies of 16385 x 512: N*m = 2,156,003,840; p, z and dp 8.6 GB each
            "int32": (((16385, 512), 257), ((7, 5), 3))}


def _bn_make(shape, size, gen, dtype):
    N, m = shape
    p = _randn(gen, dtype, N, m, scale=3.0, shift=1.0)  # non-zero column means: the statistics' centring counts
    z = (0.5 * p + _randn(gen, F64, N, m)).to(dtype).double()  # correlated with p
    # odd: the target differentiated too (the no-stop-grad ablation: the backward's second output), and
    # bn_column_stats (the loss's statistics kernel, which the other sizes test through the loss; ~1.3 s a
    # call in dry mode, whose interpreter loops over a GPU program's 512 rows)
    odd = size == "odd"
    eps = 0.05 if size == "medium" else 0.0  # the variance's eps at one size, the theory's 0 elsewhere
    return {"p": p, "z": z, "eps": eps, "stats": odd}, ("p", "z") if odd else ("p",), {"p", "z"}


def _stats_ref(p, z):
    cp, cz = p - p.mean(0), z - z.mean(0)
    var_p, var_z, cov = (cp * cp).mean(0), (cz * cz).mean(0), (cp * cz).mean(0)
    return dict(mean_p=p.mean(0), mean_z=z.mean(0), var_p=var_p, var_z=var_z, cov=cov, rho=cov / (var_p * var_z).sqrt())


def _bn_op(norm):
    def call(i, _precision):
        out = {"loss": K.bn_cosine_loss(i["p"], i["z"], out_norm=norm, eps=i["eps"], backend="triton")}
        if norm == "bn" and i["stats"]:
            stats = K.bn_column_stats(i["p"].detach(), i["z"].detach(), backend="triton")
            assert float(stats.pop("n")) == i["p"].shape[0]
            out.update(stats)
        return out

    def ref(i):
        out = {"loss": K.bn_cosine_loss_reference(i["p"], i["z"], norm, i["eps"])}
        return {**out, **(_stats_ref(i["p"].detach(), i["z"].detach()) if norm == "bn" and i["stats"] else {})}

    return Op(f"bn_cosine_loss_{norm}", _bn_make, call, ref,
              lambda i, gen: {"loss": 0.5 + torch.rand((), generator=gen, device=gen.device, dtype=F64)},
              BN_SIZES, 2, dots=False, whole=True)


# ---------------------------------------------------------------------------------------------------
# modular_power_mlp: a [B, k] tokens, U [k, p, m], W [m, p] -> logits [B, p]
# ---------------------------------------------------------------------------------------------------
def _modpow_make(shape, size, gen, dtype):
    B, k, p, m = shape
    scale = m ** (-1.0 / k) / k ** 0.5  # the sums' k-th powers summed over m neurons stay O(1)
    a = torch.randint(0, p, (B, k), generator=gen, device=gen.device)
    return {"a": a, "U": _randn(gen, dtype, k, p, m, scale=scale), "W": _randn(gen, dtype, m, p)}, ("U", "W"), {"a"}


OPS_MODPOW = Op("modular_power_mlp", _modpow_make,
                lambda i, p: {"logits": K.modular_power_mlp(i["a"], i["U"], i["W"], i["a"].shape[1], backend="triton",
                                                            input_precision=p)},
                lambda i: {"logits": K.modular_power_mlp_reference(i["a"], i["U"], i["W"], i["a"].shape[1])},
                lambda i, gen: {"logits": torch.randn(i["a"].shape[0], i["W"].shape[1], generator=gen,
                                                      device=gen.device, dtype=F64)},
                # odd: unaligned everything and a 32-wide class tile; medium / large: Fig. 4.1's and C.3's sizes
                {"odd": ((1031, 3, 23, 355), (7, 3, 5, 19)), "medium": ((1024, 4, 47, 2944), (17, 2, 7, 21)),
                 "large": ((4096, 5, 23, 5632), (5, 4, 3, 18))}, 1)

# ---------------------------------------------------------------------------------------------------
# looped_linear_attention: G [B, D, D], z0 [B, D], Q, P [D, D], eta [T] -> Z [B, T + 1, D]
# ---------------------------------------------------------------------------------------------------
def _looped_make(shape, size, gen, dtype):
    B, D, T = shape
    E = torch.randn(B, 2 * D, D, generator=gen, device=gen.device, dtype=F64)  # n = 2D examples a prompt
    G = (E.mT @ E).to(dtype).double()
    eye = torch.eye(D, device=gen.device, dtype=F64)
    # weights near the construction (Q = P = I) and steps under 1 / lambda_max: the loops contract
    eta = (0.5 / torch.linalg.eigvalsh(G).amax() * _rand(gen, F64, T, low=0.5, high=1.0)).to(dtype).double()
    inputs = {"G": G, "z0": _randn(gen, dtype, B, D), "Q": (eye + _randn(gen, F64, D, D, scale=0.1)).to(dtype).double(),
              "P": (eye + _randn(gen, F64, D, D, scale=0.1)).to(dtype).double(), "eta": eta}
    return inputs, ("G", "z0", "Q", "P", "eta"), {"G", "z0"}


def _looped_args(i):
    return i["G"], i["z0"], i["Q"], i["P"], i["eta"]


OPS_LOOPED = Op("looped_linear_attention", _looped_make,
                lambda i, p: {"Z": K.looped_linear_attention(*_looped_args(i), backend="triton")},
                lambda i: {"Z": K.looped_linear_attention_reference(*_looped_args(i))},
                lambda i, gen: {"Z": torch.randn(*i["z0"].shape[:1], len(i["eta"]) + 1, i["z0"].shape[1],
                                                 generator=gen, device=gen.device, dtype=F64)},
                # (B, D, T): odd, the chapter's d = 4 and d = 20 at 4096 prompts and 200 loops, and the largest D
                # (dry: D <= 16, the interpreter's tile)
                {"odd": ((1031, 7, 37), (5, 3, 4)), "medium": ((4096, 5, 200), (3, 5, 6)),
                 "large": ((4096, 21, 200), (3, 9, 3)), "largest": ((1024, 64, 10), (2, 16, 2))}, 1, dots=False)

# ---------------------------------------------------------------------------------------------------
# token_selection (GemFilter): q_last [B, H, Dh], keys [B, H_kv, N, Dh] -> scores [B, N], ids [B, k]
# ---------------------------------------------------------------------------------------------------
def _gem_make(shape, size, gen, dtype):
    B, H, Hkv, N, D, k = shape
    return {"q": _randn(gen, dtype, B, H, D), "keys": _randn(gen, dtype, B, Hkv, N, D), "k": k}, (), {"q", "keys"}


def _gem_outputs(scores, idx):
    """The scores and the selected tokens' scores largest first (ties may take either id; the ids ascend)."""
    assert idx.dtype == torch.int64 and bool((idx.diff(dim=-1) > 0).all())
    return {"scores": scores, "top": scores.gather(-1, idx).sort(dim=-1, descending=True).values}


OPS_GEM = Op("token_selection", _gem_make,
             lambda i, p: _gem_outputs(K.selection_scores(i["q"], i["keys"], backend="triton"),
                                       K.select_tokens(i["q"], i["keys"], i["k"], backend="triton")),
             lambda i: (lambda s: {"scores": s, "top": s.topk(i["k"], dim=-1).values})(
                 K.selection_scores_reference(i["q"], i["keys"])),
             lambda i, gen: {},  # no backward: the op's product is an index set
             # (B, H, H_kv, N, Dh, k): odd (GQA groups of 3, Dh = 24: unaligned rows), LLaMA 3.1 8B's heads at 16k and
             # 128k tokens, Phi 3.5 Mini's (no GQA, Dh = 96)
             {"odd": ((3, 6, 2, 1031, 24, 37), (2, 6, 3, 37, 24, 5)), "medium": ((1, 32, 8, 16384, 128, 1024),
                                                                             (1, 4, 2, 40, 16, 7)),
              "large": ((1, 32, 8, 131072, 128, 4096), (1, 8, 8, 33, 8, 3)),
              "mha": ((1, 32, 32, 32768, 96, 1024), (1, 3, 3, 21, 12, 4))}, 1, dots=False)

OPS = [
    _layer_op("soft_threshold", K.soft_threshold_layer, K.soft_threshold_reference, (-0.3, 0.7), 1.0,
              lambda b: (b, -b)),  # b < 0 too: the learned-bias ablation's formula
    _clamp_op("smoothed_clamp", 0.05),
    _clamp_op("smoothed_clamp_s0", 0.0),
    Op("patch_activation_sum", _patch_make,
       lambda i, p: _present(K.patch_activation_sum(i["x"], i["w"], mask=i["mask"], backend="triton",
                                                    input_precision=p, **i["opts"], **i["save"])),
       lambda i: _present(K.patch_activation_sum_reference(i["x"], i["w"], mask=i["mask"], **i["opts"])),
       _patch_upstream,
       {"odd": ((257, 17, 129, 19), (3, 5, 21, 11)), "medium": ((1024, 32, 512, 64), (4, 3, 17, 6)),
        "large": ((4096, 32, 1024, 512), (2, 4, 18, 17)),
        # 16 copies of 2049 x 32 patches x 2048: B*P*d = 2,148,532,224; x and grad_x 8.6 GB each
        "int32": (((2049, 32, 2048, 16), 16), ((2, 3, 9, 5), 3))}, 3),
    Op("masked_attention", _attn_make,
       lambda i, p: _attn_outputs(*K.masked_attention(*_attn_args(i), backend="triton", input_precision=p)),
       lambda i: _attn_outputs(*K.masked_attention_reference(*_attn_args(i))), _attn_upstream,
       {"odd": ((7, 257, 129, 65, 37), (2, 19, 9, 5, 7)), "medium": ((32, 256, 1152, 1152, 64), (2, 9, 20, 6, 5)),
        "large": ((64, 1024, 512, 512, 1024), (1, 18, 6, 7, 17)),
        # 8 copies of 911 samples x 256 keys x 1152: B*P*d = 2,149,318,656; keys (= values) 8.6 GB
        "int32": (((911, 256, 1152, 1152, 8), 8), ((2, 9, 5, 5, 3), 3))}, 3),
    _bn_op("bn"),
    _bn_op("l2"),
    OPS_MODPOW,
    OPS_LOOPED,
    OPS_GEM,
]


def _cases():
    for op in OPS:
        for size in op.sizes:
            precisions = ["fp32-ieee", "fp32-tf32", "fp64"] if op.dots else ["fp32", "fp64"]
            for precision in precisions[:1] if size == "int32" else precisions:  # int32: float32 only (memory)
                yield pytest.param(op, size, precision, id=f"{op.name}-{size}-{precision}")


def _prepare(value, dtype, copies, grad, memo):
    """A copy rounded to ``dtype``, then ``copies`` stacked along dim 0 (int32: no room for a float64 whole);
    one tensor per distinct input (values may be keys)."""
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) not in memo:
        t = value.to(dtype, copy=True) if value.is_floating_point() else value
        t = t.repeat(copies, *[1] * (t.dim() - 1)) if copies > 1 else t
        memo[id(value)] = t.detach().requires_grad_(grad) if t.is_floating_point() else t
    return memo[id(value)]


class _Error:
    """||got - want|| / ||want|| accumulated over pieces in float64; inf once anything is not finite."""

    num, den, finite = 0.0, 0.0, True

    def add(self, got, want):
        self.finite = self.finite and bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())
        diff = got.detach().double() - want
        self.num, self.den = self.num + float((diff * diff).sum()), self.den + float((want * want).sum())

    def value(self):
        return math.inf if not self.finite else math.sqrt(self.num / self.den if self.den > 0 else self.num)


def _copies(t, k):  # the k stacked copies of a block
    return [t] if k == 1 else list(t.unflatten(0, (k, -1)).unbind(0))


def test_every_triton_op_has_a_case(gpu_device):
    """A new public op with a ``backend`` argument needs a case here (infonce has none: PyTorch only)."""
    with_backend = {n for n in K.__all__ if inspect.isfunction(inspect.unwrap(getattr(K, n)))
                    and "backend" in inspect.signature(getattr(K, n)).parameters}
    assert with_backend == {"soft_threshold_layer", "smoothed_clamp_layer", "patch_activation_sum", "masked_attention",
                            "bn_cosine_loss", "bn_column_stats", "modular_power_mlp", "looped_linear_attention",
                            "selection_scores", "select_tokens"}


@pytest.mark.parametrize("op,size,precision", list(_cases()))
def test_op_matches_float64_reference(poisoned, gpu_device, pick, request, op, size, precision):
    dtype, input_precision, tol = PRECISIONS[precision]
    cuda, tiny = op.sizes[size]
    shape, k = pick(*(cuda, tiny) if size == "int32" else ((cuda, 1), (tiny, 1)))
    if gpu_device.type == "cuda" and size == "int32":
        assert k * math.prod(shape[:op.index_dims]) > 2**31
    gen = torch.Generator(device=gpu_device).manual_seed(zlib.crc32(request.node.name.encode()))
    inputs, need, rows = op.make(shape, size, gen, dtype)

    # the reference on the block, its graph kept for one backward per copy
    ref_in = {n: v.detach().requires_grad_(n in need) if isinstance(v, torch.Tensor) and v.is_floating_point()
              else v for n, v in inputs.items()}
    ref_out = op.ref(ref_in)
    ups = [op.upstream(ref_in, gen) for _ in range(1 if op.whole else k)]

    # the op on k copies of the block, in the run's dtype
    memo = {}
    big = {n: _prepare(v, dtype, k if n in rows else 1, n in need, memo) for n, v in inputs.items()}
    out = op.call(big, input_precision)
    assert out.keys() == ref_out.keys(), (sorted(out), sorted(ref_out))
    grads = {n: (ups[0][n] if op.whole else torch.cat([u[n] for u in ups])).to(dtype) for n in ups[0]}
    torch.autograd.backward([out[n] for n in grads], [grads[n] for n in grads])
    del grads

    errors = {n: _Error() for n in [*out, *(f"grad_{n}" for n in need)]}
    for name, value in out.items():
        assert value.dtype == (F64 if name in STATS else dtype) and not (value.requires_grad and name not in ups[0])
        for piece in _copies(value, 1 if op.whole else k):
            errors[name].add(piece, ref_out[name].detach())
    shared = {}
    for c in range(k):
        u = ups[0 if op.whole else c]
        if c == 0 or not op.whole:  # one backward of the reference per fresh upstream gradient
            ref_grads = torch.autograd.grad([ref_out[n] for n in u], [ref_in[n] for n in need], [u[n] for n in u],
                                            retain_graph=True) if need else ()  # (): an op with no backward
        for n, g in zip(need, ref_grads):
            g = g / k if op.whole else g  # a loss over k copies gives each row 1/k of the block's gradient
            if n in rows:
                errors[f"grad_{n}"].add(_copies(big[n].grad, k)[c], g)
            else:
                shared[n] = g if n not in shared else shared[n] + g
    for n, g in shared.items():
        errors[f"grad_{n}"].add(big[n].grad, g)
    del big, out, ref_in, ref_out, ref_grads, shared  # a failure's traceback must not hold 26 GB of CUDA memory
    values = {n: e.value() for n, e in errors.items()}
    print(request.node.name, {n: f"{v:.1e}" for n, v in values.items()})  # the measured errors (pytest -rP)
    bad = {n: f"{v:.2e}" for n, v in values.items() if not v <= tol}
    assert not bad, f"relative error above {tol:.0e} (NaN/inf: unwritten or broken cells): {bad}"
