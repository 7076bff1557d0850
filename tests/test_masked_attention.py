"""masked_attention: Triton (interpreter) and PyTorch fallback against a float64 reference and SDPA."""
import importlib
import itertools

import pytest
import torch

from featlearn.errors import ConfigError

ma = importlib.import_module("featlearn.kernels.masked_attention")

# (B, R or Pq, P, d, dv): odd sizes straddling the 16-wide interpreter tiles (P = 37: three key tiles, the
# last partial; d = 41: three d-tiles in the logits loop; dv = 19: two output tiles), plus degenerate ones
SHAPES = [(3, 13, 37, 41, 19), (2, 5, 7, 1, 1), (1, 17, 16, 16, 33)]
# vs float64 on the same rounded inputs: an output is a softmax over d-term logits (|logit| <~ 4), so
# rounding is ~sqrt(d) eps * 4 relative: fp32 (eps 6e-8) 2e-5 leaves > 10x margin; fp64 1e-12 catches a
# float32 accumulator (~1e-7) by five orders. An indexing or masking bug gives O(1e-2..1) errors.
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
TF32_TOL = 1e-2  # TF32 keeps 10 mantissa bits (~5e-4 per operand); 1e-2 is what a float32 run may spend
DTYPES = [torch.float32, torch.float64]
MODES = ["shared", "index", "per_sample"]  # shared rows (all, in order), shared rows by index, per-sample


def _inputs(seed, shape, mode, pad, n_groups, logit_scale=2.0):
    """Float64 inputs: logits ~ N(0, logit_scale^2); an index with repeated rows; a padding mask that
    leaves every sample a key; group ids covering [0, n_groups)."""
    B, n, P, D, DV = shape
    g = torch.Generator().manual_seed(seed)
    R = n + 3
    args = {"keys": torch.randn(B, P, D, generator=g, dtype=torch.float64),
            "values": torch.randn(B, P, DV, generator=g, dtype=torch.float64)}
    scale = logit_scale / D ** 0.5
    if mode == "per_sample":
        args["queries"] = scale * torch.randn(B, n, D, generator=g, dtype=torch.float64)
    elif mode == "index":
        args["queries"] = scale * torch.randn(R, D, generator=g, dtype=torch.float64)
        idx = torch.randint(0, R, (B, n), generator=g)
        idx[:, -1] = idx[:, 0]  # a row gathered twice in a sample: its gradient is a sum
        args["query_index"] = idx
    else:
        args["queries"] = scale * torch.randn(n, D, generator=g, dtype=torch.float64)
    if pad:
        mask = torch.rand(B, P, generator=g) < 0.4
        mask[:, 0] = False
        args["key_padding_mask"] = mask
    if n_groups:
        args["key_groups"] = torch.randint(0, n_groups, (B, P), generator=g)
        args["n_groups"] = n_groups
    grad = torch.randn(B, n, DV, generator=g, dtype=torch.float64)
    return args, grad


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return (out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _cast(args, dtype, need=("queries",)):
    """Fresh leaf copies of the floating inputs in ``dtype`` (those in ``need`` requiring grad)."""
    return {k: (v.detach().to(dtype, copy=True).requires_grad_(k in need)
                if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in args.items()}


def _compare(backend, dtype, args, grad, need=("queries",), input_precision="ieee"):
    """Relative errors of out, group_attn and the gradients of ``need`` against float64 (same rounded inputs)."""
    ins = _cast(args, dtype, need)
    ref_in = _cast(ins, torch.float64, need)
    ref, ref_groups = ma.masked_attention_reference(**ref_in)
    ref.backward(grad)
    out, groups = ma.masked_attention(**ins, backend=backend, input_precision=input_precision)
    out.backward(grad.to(dtype))
    assert out.dtype == dtype and out.shape == ref.shape
    errs = [_rel(out, ref.detach())]
    if ref_groups is None:
        assert groups is None
    else:
        assert groups.dtype == dtype and groups.shape == ref_groups.shape and not groups.requires_grad
        errs.append(_rel(groups, ref_groups))
    for name in need:
        assert ins[name].grad.dtype == dtype
        errs.append(_rel(ins[name].grad, ref_in[name].grad))
    return errs


CASES = [(shape, mode, pad, groups) for shape, mode, (pad, groups) in
         itertools.product(SHAPES, MODES, [(False, 0), (True, 3), (False, 5)])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape,mode,pad,n_groups,seed", [(*c, i) for i, c in enumerate(CASES)])
def test_forward_backward_vs_float64(poisoned, backend, shape, mode, pad, n_groups, seed, dtype):
    args, grad = _inputs(seed, shape, mode, pad, n_groups)
    assert max(_compare(backend, dtype, args, grad)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["index", "per_sample"])
def test_fully_padded_key_tiles(poisoned, backend, mode, dtype):
    """P = 37 (three 16-wide interpreter key tiles): sample 0 pads keys 0-15 (its whole first tile), sample 1
    keys 16-36 (its last two tiles), so the online softmax starts from, or ends with, tiles of -inf logits."""
    args, grad = _inputs(43, (2, 9, 37, 41, 19), mode, True, 3)
    mask = torch.zeros(2, 37, dtype=torch.bool)
    mask[0, :16] = True
    mask[1, 16:] = True
    args["key_padding_mask"] = mask
    assert max(_compare(backend, dtype, args, grad)) < TOL[dtype]
    out, groups = ma.masked_attention(**_cast(args, dtype, ()), backend=backend)
    ref, ref_groups = ma.masked_attention_reference(**args)
    # a padded key takes no attention: its group share comes from the unpadded keys only
    only_unpadded = {**args, "values": args["values"] * (~mask).unsqueeze(-1)}
    torch.testing.assert_close(ma.masked_attention_reference(**only_unpadded)[0], ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(groups.double().sum(-1), torch.ones(2, 9, dtype=torch.float64), atol=10 * TOL[dtype])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_large_logits_stay_accurate(poisoned, backend):
    # logits ~ +-30 (a trained MAE reaches log(P/eps) ~ 10-20): the online max keeps exp() in range
    args, grad = _inputs(40, (2, 9, 37, 41, 19), "index", True, 3, logit_scale=15.0)
    assert max(_compare(backend, torch.float64, args, grad)) < TOL[torch.float64]
    assert max(_compare(backend, torch.float32, args, grad)) < 20 * TOL[torch.float32]  # fp32 logits ~30 eps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need", [("keys",), ("values",), ("queries", "keys", "values")])
def test_torch_backend_gradients_of_keys_and_values(need, dtype):
    args, grad = _inputs(41, (2, 7, 11, 9, 5), "index", True, 0)
    assert max(_compare("torch", dtype, args, grad, need)) < TOL[dtype]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pad", [False, True])
def test_group_attention_rows_sum_to_one(backend, pad):
    # every key has a group (padded keys too, with attention 0): the groups partition the attention
    args, _ = _inputs(42, (3, 13, 37, 41, 19), "index", pad, 4)
    _, groups = ma.masked_attention(**args, backend=backend)
    assert groups.shape == (3, 13, 4) and (groups >= 0).all()
    assert torch.allclose(groups.sum(-1), torch.ones(3, 13, dtype=torch.float64), atol=1e-12, rtol=0)
    # one group per key: group_attn is the attention matrix itself
    P = args["keys"].shape[1]
    args["key_groups"], args["n_groups"] = torch.arange(P).expand(3, P).contiguous(), P
    _, attn = ma.masked_attention(**args, backend=backend)
    s = torch.einsum("bid,bqd->biq", args["queries"][args["query_index"]], args["keys"])
    if pad:
        s = s.masked_fill(args["key_padding_mask"][:, None, :], float("-inf"))
    assert torch.allclose(attn, torch.softmax(s, -1), atol=1e-14, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pad", [False, True])
def test_matches_scaled_dot_product_attention(backend, pad):
    # where the semantics coincide: per-sample queries, scale 1, bool attn_mask = keys taking part
    args, grad = _inputs(43, (3, 13, 37, 41, 19), "per_sample", pad, 0)
    q = args["queries"].clone().requires_grad_()
    mask = None if not pad else ~args["key_padding_mask"][:, None, :]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q, args["keys"], args["values"], attn_mask=mask,
                                                               scale=1.0)
    (dq_ref,) = torch.autograd.grad((ref * grad).sum(), q)
    args["queries"] = args["queries"].clone().requires_grad_()
    out, _ = ma.masked_attention(**args, backend=backend)
    (dq,) = torch.autograd.grad((out * grad).sum(), args["queries"])
    assert _rel(out, ref.detach()) < 1e-12 and _rel(dq, dq_ref) < 1e-12


@pytest.mark.parametrize("precision", ["tf32", "auto"])
def test_float32_tf32_within_tf32_tolerance(poisoned, precision):
    # the float32 default ("auto" = TF32). The interpreter multiplies in full float32, so here this checks
    # that the TF32 variants compile, launch and write every cell; on a GPU it bounds TF32 rounding
    args, grad = _inputs(44, (3, 13, 37, 41, 19), "index", True, 3)
    assert max(_compare("triton", torch.float32, args, grad, input_precision=precision)) < TF32_TOL


@pytest.mark.parametrize("precision", ["tf32", "auto"])
def test_float64_ignores_tf32(poisoned, precision):
    args, grad = _inputs(45, (2, 9, 23, 17, 5), "index", True, 2)
    assert max(_compare("triton", torch.float64, args, grad, input_precision=precision)) < TOL[torch.float64]


def test_shared_row_gradient_sums_every_gather():
    # all queries read row 2: its gradient is the sum over (b, i), the other rows get none
    args, grad = _inputs(46, (2, 4, 9, 6, 3), "index", False, 0)
    args["query_index"] = torch.full((2, 4), 2)
    per_sample = args["queries"][args["query_index"]].detach().requires_grad_()
    for backend in ("torch", "triton"):
        rows = args["queries"].clone().requires_grad_()
        out, _ = ma.masked_attention(**{**args, "queries": rows}, backend=backend)
        (out * grad).sum().backward()
        ref, _ = ma.masked_attention_reference(per_sample, args["keys"], args["values"])
        (dq,) = torch.autograd.grad((ref * grad).sum(), per_sample)
        assert torch.allclose(rows.grad[2], dq.sum((0, 1)), atol=1e-12, rtol=0)
        assert rows.grad[[0, 1, 3, 4, 5, 6]].abs().max() == 0


def test_triton_accepts_keys_requiring_grad_under_no_grad():
    args, _ = _inputs(47, (2, 5, 9, 6, 3), "shared", False, 0)
    args["keys"].requires_grad_()
    with torch.no_grad():
        out, _ = ma.masked_attention(**args, backend="triton")
    ref, _ = ma.masked_attention_reference(**args)
    assert _rel(out, ref.detach()) < 1e-12


# ----------------------------------------------------------------------------------------------
# refusals: a KernelInputError naming the argument, before the autograd.Function runs
# ----------------------------------------------------------------------------------------------
def _bad_cases():
    args, _ = _inputs(48, (2, 5, 9, 6, 3), "index", True, 3)

    def case(field, fragment, **change):
        return field, {**args, **change}, fragment

    yield case("keys", "has shape [2, 9]", keys=args["keys"][:, :, 0])
    yield case("values", "has shape [2, 8, 3]", values=args["values"][:, :8])
    yield case("queries", "has shape [8, 5]", queries=torch.zeros(8, 5, dtype=torch.float64))
    yield case("queries", "has shape [3, 5, 6]", queries=torch.zeros(3, 5, 6, dtype=torch.float64), query_index=None)
    yield case("query_index", "is given with per-sample queries", queries=torch.zeros(2, 5, 6, dtype=torch.float64))
    yield case("query_index", "has rows out of range; must hold rows in [0, R = 8)",
               query_index=args["query_index"] + 8)
    yield case("query_index", "has rows out of range", query_index=args["query_index"] - 8)
    yield case("query_index", "has dtype torch.int32", query_index=args["query_index"].int())
    yield case("query_index", "has shape [3, 5]; must have shape (2, >= 1)",
               query_index=torch.zeros(3, 5, dtype=torch.long))
    yield case("query_index", "has shape [2, 0]", query_index=torch.zeros(2, 0, dtype=torch.long))
    yield case("query_index", "is a list", query_index=[[0, 1], [2, 3]])
    yield case("key_padding_mask", "has dtype torch.uint8", key_padding_mask=args["key_padding_mask"].to(torch.uint8))
    yield case("key_padding_mask", "has shape [2, 8]", key_padding_mask=args["key_padding_mask"][:, :8])
    yield case("key_padding_mask", "leaves out every key of a sample",
               key_padding_mask=torch.ones(2, 9, dtype=torch.bool))
    yield case("key_groups", "has ids out of range; must hold group ids in [0, n_groups = 3)",
               key_groups=args["key_groups"] + 1)
    yield case("key_groups", "has dtype torch.int32", key_groups=args["key_groups"].int())
    yield case("queries", "has dtype torch.float16;", queries=args["queries"].half())
    yield case("keys", "has dtype torch.float32 but queries has torch.float64;", keys=args["keys"].float())
    yield case("values", "has dtype torch.int64;", values=args["values"].long())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("field,args,fragment", list(_bad_cases()), ids=itertools.count())
def test_bad_inputs_refused_before_any_work(refused_before_work, backend, field, args, fragment):
    error = refused_before_work(ma.MaskedAttentionFunction, lambda: ma.masked_attention(**args, backend=backend))
    msg = str(error)
    assert msg.startswith(f"masked_attention: {field} {fragment}"), msg
    assert error.field == field and isinstance(error, ConfigError)


def test_value_checks_can_be_skipped_shape_checks_cannot():
    """``check_values=False`` (the modules after their first step: no per-call host sync) gives the same result
    on valid input and skips only the range checks; shape and dtype refusals stay."""
    args, _ = _inputs(50, (2, 5, 9, 6, 3), "index", True, 3)
    checked, skipped = ma.masked_attention(**args), ma.masked_attention(**args, check_values=False)
    assert torch.equal(checked[0], skipped[0]) and torch.equal(checked[1], skipped[1])
    with pytest.raises(ConfigError, match="query_index has dtype torch.int32"):
        ma.masked_attention(**{**args, "query_index": args["query_index"].int()}, check_values=False)


@pytest.mark.parametrize("name", ["keys", "values"])
def test_triton_refuses_keys_or_values_requiring_grad(refused_before_work, name):
    args, _ = _inputs(49, (2, 5, 9, 6, 3), "shared", False, 0)
    args[name] = args[name].clone().requires_grad_()
    error = refused_before_work(ma.MaskedAttentionFunction, lambda: ma.masked_attention(**args, backend="triton"))
    assert str(error).startswith(f"masked_attention: {name} requires grad; the Triton path differentiates queries")


@pytest.mark.parametrize("change,field", [
    (dict(n_groups=0), "n_groups"), (dict(key_groups=None), "n_groups"), (dict(n_groups=-1), "n_groups"),
    (dict(n_groups=2.0), "n_groups"), (dict(backend="cuda"), "backend"), (dict(input_precision="bf16"),
                                                                          "input_precision")])
def test_bad_options_refused(change, field):
    args, _ = _inputs(50, (2, 5, 9, 6, 3), "shared", False, 3)
    with pytest.raises(ConfigError, match=f"^{field}: must be"):
        ma.masked_attention(**{**args, **change})
