"""SparseCodingDataModule: sampler statistics, determinism, RandomMask views, view cross-covariance."""
import math

import pytest
import torch

from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.errors import ConfigError


def _z_score(est, mean, var, n):
    return abs(est - mean) / math.sqrt(var / n)


@pytest.mark.parametrize("dictionary", ["random", "coordinate"])
def test_dictionary_orthonormal(dictionary):
    dm = SparseCodingDataModule(d=24, d1=200, dictionary=dictionary, seed=5)
    M = dm.M.double()
    assert M.shape == (200, 24) and dm.features.shape == (24, 200)
    assert torch.allclose(M.t() @ M, torch.eye(24, dtype=torch.float64), atol=1e-6)
    if dictionary == "random":
        # delocalised: ||M_j||_inf ~ sqrt(2 log(d1 d)/d1) (Gaussian max); 1.5x margin, a basis vector has 1
        assert M.abs().max() < 1.5 * math.sqrt(2 * math.log(200 * 24) / 200)
    else:
        assert ((M != 0).sum(0) == 1).all() and ((M != 0).sum(1) <= 1).all()
    # the same seed gives the same dictionary, another seed a different one
    assert torch.equal(dm.M, SparseCodingDataModule(d=24, d1=200, dictionary=dictionary, seed=5).M)
    assert not torch.equal(dm.M, SparseCodingDataModule(d=24, d1=200, dictionary=dictionary, seed=6).M)


def test_sampler_statistics():
    dm = SparseCodingDataModule(d=32, d1=96, seed=1, C_z=2.0)
    n = 20000
    s = dm.sample(torch.arange(n), "val")
    z, xi, x = s["z"], s["xi"], s["x"]
    p = dm.p
    assert p == pytest.approx(2 * math.log(math.log(32)) / 32)
    assert dm.sigma_xi ** 2 == pytest.approx(math.sqrt(math.log(32)) / 32)
    # z in {-1,0,1}; Pr(|z_j| = 1) = p, symmetric signs; 5-sigma tolerances over n*d Bernoulli draws
    assert set(z.unique().tolist()) <= {-1.0, 0.0, 1.0}
    N = n * 32
    assert _z_score(float((z != 0).float().mean()), p, p * (1 - p), N) < 5
    assert _z_score(float((z == 1).float().mean()), p / 2, p / 2 * (1 - p / 2), N) < 5
    # noise: mean 0, std sigma (std of the sample variance of a Gaussian is sigma^2 sqrt(2/N))
    N = n * 96
    s2 = dm.sigma_xi ** 2
    assert _z_score(float(xi.double().var()), s2, 2 * s2 ** 2, N) < 5
    assert _z_score(float(xi.double().mean()), 0.0, s2, N) < 5
    # x = M z + xi exactly; labels y = <w*, z>, |w*_j| in [0.5, 1.5]
    assert torch.allclose(x, z @ dm.M.t() + xi, atol=1e-5)
    assert ((dm.w_star.abs() >= 0.5) & (dm.w_star.abs() <= 1.5)).all()
    assert torch.allclose(s["y_reg"], z @ dm.w_star, atol=1e-5)
    assert torch.equal(s["y_cls"], torch.sign(s["y_reg"]))


def test_deterministic_per_seed_and_index_independent_of_batch():
    kw = dict(d=16, d1=64, num_negatives=12, seed=4)
    dm_a = SparseCodingDataModule(batch_size=4, **kw)
    full = dm_a.sample(torch.arange(20), "train")
    part = SparseCodingDataModule(batch_size=4, **kw).sample(torch.arange(7, 13), "train")
    for key in ("x", "z", "xi", "x_a", "x_q", "x_neg", "y_reg"):
        assert torch.equal(full[key][7:13], part[key]), key
    # reversed order: same per-index samples
    rev = dm_a.sample(torch.arange(19, -1, -1), "train")
    assert torch.equal(rev["x_a"].flip(0), full["x_a"])
    # splits and seeds differ
    assert not torch.equal(dm_a.sample(torch.arange(5), "val")["x"], full["x"][:5])
    other = SparseCodingDataModule(batch_size=4, **{**kw, "seed": 5}).sample(torch.arange(5), "train")
    assert not torch.equal(other["x"], full["x"][:5])
    # the shared pool: N negatives made of ceil(N/K) = 3 per anchor
    batch = dm_a.batch(torch.arange(4), "train")
    assert batch["x_neg"].shape == (12, 64)
    assert torch.equal(batch["x_neg"], full["x_neg"][:4].reshape(-1, 64))
    per = SparseCodingDataModule(batch_size=4, negatives="per_anchor", **kw).batch(torch.arange(4), "train")
    assert per["x_neg"].shape == (4, 12, 64)


def test_random_mask_views():
    dm = SparseCodingDataModule(d=16, d1=64, num_negatives=64, batch_size=64, seed=2)
    b = dm.batch(torch.arange(64), "train")
    x, xa, xq = b["x"], b["x_a"], b["x_q"]
    assert torch.allclose(xa + xq, 2 * x)                # complementary, factor 2
    assert torch.equal(xa * xq, torch.zeros_like(x))     # disjoint
    kept = (xa != 0).double().mean()
    assert _z_score(float(kept), 0.5, 0.25, x.numel()) < 5  # Bernoulli(1/2) mask
    assert (b["x_neg"] != 0).all()                       # negatives are not augmented by default
    dm_neg = SparseCodingDataModule(d=16, d1=64, num_negatives=64, batch_size=64, seed=2, augment_negatives=True)
    neg = dm_neg.batch(torch.arange(64), "train")["x_neg"]
    assert _z_score(float((neg == 0).double().mean()), 0.5, 0.25, neg.numel()) < 5
    none = SparseCodingDataModule(d=16, d1=64, num_negatives=64, batch_size=64, seed=2, augment="none")
    bn = none.batch(torch.arange(64), "train")
    assert torch.equal(bn["x_a"], bn["x"]) and torch.equal(bn["x_q"], bn["x"])
    # general mask probability q: views D x / q and (I - D) x / (1 - q) still sum to 2x only for q = 1/2,
    # but E over D of each view is x: check the rescaling on kept coordinates
    dq = SparseCodingDataModule(d=16, d1=64, num_negatives=8, batch_size=8, seed=2, mask_prob=0.25)
    bq = dq.batch(torch.arange(8), "train")
    on = bq["x_a"] != 0
    assert torch.allclose(bq["x_a"][on], bq["x"][on] / 0.25) and torch.allclose(bq["x_q"][~on], bq["x"][~on] / 0.75)


def _monte_carlo_cross_cov(dm, n, chunk=50000):
    acc = torch.zeros(dm.d1, dm.d1, dtype=torch.float64)
    for start in range(0, n, chunk):
        s = dm.sample(torch.arange(start, start + chunk), "train")
        acc += s["x_a"].double().t() @ s["x_q"].double()
    return acc / n


def test_view_cross_covariance_identity():
    """E[x_a x_q^T] = Sigma_x - Diag(Sigma_x) = p (MM^T - Diag(MM^T)) with RandomMask; Sigma_x without.

    Monte Carlo with n = 2e5 (d=16, d1=64): the estimate's Frobenius error is ~ d1 * 4 Var(x_l) / sqrt(n)
    ~ 0.05 against ||C_aug||_F ~ p sqrt(d) ~ 0.26, i.e. ~20%. The formula that forgets the
    noise cancellation (Sigma_x) is off by ||sigma^2 I + p Diag(MM^T)||_F ~ 0.85 (> 300%).
    The projection onto span(M) averages over d1 coordinates and is checked to 15%.
    """
    n = 200000
    dm = SparseCodingDataModule(d=16, d1=64, num_negatives=1, batch_size=50000, seed=0)
    C = dm.view_cross_covariance()
    sigma = dm.covariance()
    assert torch.allclose(C, dm.p * (dm.M.double() @ dm.M.double().t())
                          - torch.diag(torch.diagonal(dm.p * dm.M.double() @ dm.M.double().t())), atol=1e-12)
    est = _monte_carlo_cross_cov(dm, n)
    rel = (est - C).norm() / C.norm()
    wrong = (est - sigma).norm() / C.norm()
    assert rel < 0.35, rel
    assert wrong > 2.0, wrong
    M = dm.M.double()
    proj_rel = (M.t() @ (est - C) @ M).norm() / (M.t() @ C @ M).norm()
    assert proj_rel < 0.15, proj_rel
    # without augmentation the cross-covariance is Sigma_x (relative error ~ 7% at this n)
    dm_na = SparseCodingDataModule(d=16, d1=64, num_negatives=1, batch_size=50000, seed=0, augment="none")
    est_na = _monte_carlo_cross_cov(dm_na, n)
    assert (est_na - sigma).norm() / sigma.norm() < 0.15


def test_coordinate_dictionary_has_zero_cross_covariance():
    dm = SparseCodingDataModule(d=16, d1=64, dictionary="coordinate")
    assert dm.view_cross_covariance().abs().max() < 1e-12


def test_raw_probe_population_value():
    dm = SparseCodingDataModule(d=32, d1=256)
    assert dm.raw_probe_nmse() == pytest.approx(0.60, abs=0.01)  # sigma^2 / (p + sigma^2) = 0.60 at d=32


def test_test_stage_reads_the_validation_then_the_test_split():
    """The probes of the test stage are fitted on the validation split and scored on the test split."""
    dm = SparseCodingDataModule(d=8, d1=32, batch_size=16, num_negatives=16, num_val=40, num_test=24)
    for loader, split in zip(dm.test_dataloader(), ("val", "test")):
        index = torch.cat([dm.on_after_batch_transfer(b, 0)["index"] for b in loader])
        assert torch.equal(index, torch.arange(dm.sizes[split]))
        assert all(b["split"] == split for b in loader)


@pytest.mark.parametrize("kw,field", [({"d": 2}, "data.d"), ({"d1": 16}, "data.d1"), ({"mask_prob": 1.0}, "data.mask_prob"),
                                      ({"augment": "crop"}, "data.augment"), ({"dictionary": "dct"}, "data.dictionary"),
                                      ({"negatives": "queue"}, "data.negatives"), ({"num_negatives": 0}, "data.num_negatives"),
                                      ({"C_z": 0}, "data.C_z"), ({"mode": "stream"}, "data.mode")])
def test_config_errors(kw, field):
    with pytest.raises(ConfigError, match=field):
        SparseCodingDataModule(**kw)
