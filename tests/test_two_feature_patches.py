"""Two-feature patch sampler (Wen & Li 2022, Def. 3.1, eq. 3.2): exact structure, statistics and determinism."""
import math

import pytest
import torch

from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.errors import ConfigError
from featlearn.theory.noncontrastive import hypergeometric_moments


def _dm(**kw):
    base = dict(dim=13, num_patches=10, num_feature_patches=3, alphas=[4.0, 2.7], noise_std=1.5, batch_size=16)
    base.update(kw)
    return TwoFeaturePatchDataModule(**base)


def test_structure_exact():
    dm = _dm()
    b = dm.sample(torch.arange(300), "train")
    x, S, v1 = b["x"], b["feature_mask"], b["view1"]
    assert x.shape == (300, 10, 13) and x.dtype == torch.float64
    assert (S.sum(1) == 3).all() and (v1.sum(1) == 5).all()            # |S| = P0, |view| = P/2
    v = dm.features
    assert torch.allclose(v @ v.T, torch.eye(2, dtype=v.dtype), atol=1e-12)
    coef = x @ v.T                                                      # [B, P, 2]
    # feature patches are exactly s * alpha_ell * v_ell, with no noise
    expect = torch.zeros_like(coef)
    rows = torch.arange(300)
    expect[rows, :, b["ell"]] = (b["sign"] * torch.tensor(dm.alphas, dtype=x.dtype)[b["ell"]])[:, None]
    assert torch.allclose(coef[S], expect[S], atol=1e-12)
    assert torch.allclose(x[S], coef[S] @ v, atol=1e-12)                # lies in span(v1, v2)
    # noise patches are orthogonal to span(v1, v2)
    assert coef[~S].abs().max() < 1e-12
    assert set(b["sign"].tolist()) == {-1.0, 1.0}


def test_statistics():
    P, P0, n = 16, 4, 6000
    dm = _dm(num_patches=P, num_feature_patches=P0, dim=9, noise_std=1.5)
    b = dm.sample(torch.arange(n), "train")
    k = dict(hypergeometric_moments(P, P0))
    a = (b["feature_mask"] & b["view1"]).sum(1).double()
    # a ~ Hypergeometric(P, P0, P/2): mean P0/2 within 5 standard errors, variance within 5 SE of var
    assert abs(a.mean() - k["E_a"]) < 5 * math.sqrt(k["V_a"] / n)
    assert abs(a.var() - k["V_a"]) < 5 * k["V_a"] * math.sqrt(2 / n) + 0.05
    # ell uniform, sign symmetric: binomial standard errors
    assert abs(b["ell"].double().mean() - 0.5) < 5 * 0.5 / math.sqrt(n)
    assert abs(b["sign"].mean()) < 5 / math.sqrt(n)
    # per-coordinate noise variance in span(v)^perp is noise_std^2 (features are e1, e2 here)
    noise = b["x"][~b["feature_mask"]][:, 2:]
    assert abs(noise.var() - 1.5 ** 2) < 0.03 * 1.5 ** 2
    assert abs(noise.mean()) < 0.01
    # every patch position is a feature patch with probability P0 / P
    assert torch.allclose(b["feature_mask"].double().mean(0), torch.full((P,), P0 / P, dtype=torch.float64),
                          atol=5 * math.sqrt(0.25 / n))
    # the views are independent of the feature set's position
    assert abs(b["view1"].double().mean() - 0.5) < 1e-12


def test_opt_constant_matches_hand_computed_value():
    k = hypergeometric_moments(32, 8)
    assert k["V_a"] == pytest.approx(1.5484, abs=1e-4)
    assert k["C0"] / 2 == pytest.approx(7.2258, abs=1e-4) and k["C1"] / 2 == pytest.approx(8.7742, abs=1e-4)
    assert k["OPT"] == pytest.approx(0.35294, abs=1e-5)


def test_deterministic_per_seed_and_index():
    dm = _dm()
    full = dm.sample(torch.arange(12), "train")
    part = dm.sample(torch.tensor([7, 3]), "train")
    for key in full:
        assert torch.equal(full[key][[7, 3]], part[key])
    again = _dm().sample(torch.arange(12), "train")
    assert all(torch.equal(full[k], again[k]) for k in full)
    other_seed = _dm(seed=1).sample(torch.arange(12), "train")
    assert not torch.equal(full["x"], other_seed["x"])
    val = dm.sample(torch.arange(12), "val")
    assert not torch.equal(full["x"], val["x"])
    assert not torch.equal(full["view1"], val["view1"])
    # float32 data is the float64 data rounded (same random numbers)
    f32 = _dm(dtype="float32").sample(torch.arange(12), "train")
    assert torch.allclose(f32["x"].double(), full["x"], atol=1e-5)


def test_views_are_complementary_halves():
    dm = _dm()
    b = dm.sample(torch.arange(50), "train")
    x1, x2 = dm.augment(b)
    assert torch.equal(x1 + x2, b["x"])
    assert ((x1 != 0).any(-1) & (x2 != 0).any(-1)).sum() == 0           # non-overlapping
    # every 5-subset of 10 is possible: many distinct views across samples
    assert len({tuple(r.tolist()) for r in b["view1"]}) > 40


def test_random_basis_and_variants():
    dm = _dm(random_basis=True, seed=3)
    v = dm.features
    assert torch.allclose(v @ v.T, torch.eye(2, dtype=v.dtype), atol=1e-12)
    assert v[:, :2].abs().max() < 0.99                                  # not the standard basis
    b = dm.sample(torch.arange(100), "train")
    assert (b["x"][~b["feature_mask"]] @ v.T).abs().max() < 1e-10
    co_dm = _dm(co_occur=True)
    co = co_dm.sample(torch.arange(100), "train")
    coef = co["x"] @ co_dm.features.T
    on1 = (coef[..., 0].abs() > 0).sum(1)
    on2 = (coef[..., 1].abs() > 0).sum(1)
    assert (on1 == 2).all() and (on2 == 1).all()                        # ceil(3/2) patches v1, rest v2
    imb = _dm(feature_probs=[0.9, 0.1]).sample(torch.arange(4000), "train")
    assert abs(imb["ell"].double().mean() - 0.1) < 5 * math.sqrt(0.09 / 4000)
    three = _dm(alphas=[5.0, 3.0, 2.0]).sample(torch.arange(3000), "train")
    assert set(three["ell"].tolist()) == {0, 1, 2}


@pytest.mark.parametrize("kw, field", [
    (dict(num_patches=9), "data.num_patches"),
    (dict(num_feature_patches=0), "data.num_feature_patches"),
    (dict(alphas=[4.0]), "data.alphas"),
    (dict(alphas=[4.0, -1.0]), "data.alphas"),
    (dict(dim=2), "data.dim"),
    (dict(noise_std=0.0), "data.noise_std"),
    (dict(feature_probs=[0.5, 0.6]), "data.feature_probs"),
    (dict(dtype="float16"), "data.dtype"),
    (dict(co_occur=True, alphas=[3.0, 2.0, 1.0]), "data.co_occur"),
])
def test_config_errors(kw, field):
    with pytest.raises(ConfigError, match=field):
        _dm(**kw)
