"""The multi-view sampler (Pan et al. 2023, Def. 3.1) against its stated statistics."""
import math

import pytest
import torch

from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.errors import ConfigError


def coefficients(dm, batch):
    """Feature coefficients per patch ``[B, P, 2k]`` (z + alpha + noise projection)."""
    return batch["x"] @ dm.features.T


@pytest.fixture(scope="module")
def dm():
    return MultiViewDataModule(k=6, d=40, P=24, C_p=2, s=2.0, mu=0.3, rho=0.1, sigma_p=0.004, gamma=0.001,
                               num_pretrain=3001, seed=3)


def test_features_orthonormal():
    for basis in ("identity", "random"):
        V = MultiViewDataModule(k=5, d=23, P=10, s=1, basis=basis).features.double()
        assert V.shape == (10, 23)
        torch.testing.assert_close(V @ V.T, torch.eye(10, dtype=torch.float64), atol=1e-6, rtol=0)


def test_patches_and_coefficient_ranges(dm):
    b = dm.full("train")
    z = coefficients(dm, b)
    on = z > 0.03                                    # smallest coefficient: rho / C_p = 0.05; noise 4 sigma = 0.016
    assert (on.sum(-1) <= 1).all(), "feature patch sets must be disjoint"
    per_feature = on.sum(1)                         # [B, 2k]
    assert ((per_feature == 0) | (per_feature == dm.C_p)).all(), "each present feature sits on C_p patches"
    own = torch.nn.functional.one_hot(b["y"], dm.k).repeat_interleave(2, 1).bool()
    total = (z * on).sum(1)                         # coefficient sum S_v (+ <= C_p gamma + noise)
    slack = dm.C_p * (dm.gamma + 4 * dm.sigma_p)
    single, weak = b["single_view"], torch.zeros_like(own)
    weak[single] = own[single] & (torch.arange(2 * dm.k) % 2 != b["main_view"][single, None])
    strong = own & ~weak
    assert (per_feature[own & ~weak] == dm.C_p).all()
    assert (total[strong] > 1 - slack).all() and (total[strong] < 1.2 + slack).all()
    off = (per_feature > 0) & ~own
    assert (total[off] > 0.2 - slack).all() and (total[off] < 0.4 + slack).all()
    w = (z[weak.unsqueeze(1).expand_as(z)]).view(-1, dm.P).max(1).values * dm.C_p
    assert (w > dm.rho - slack).all() and (w < 1.2 * dm.rho + slack).all()


def test_view_and_offclass_frequencies(dm):
    b = dm.full("train")
    n = len(b["y"])
    assert abs(b["single_view"].double().mean() - dm.mu) < 4 * math.sqrt(dm.mu * (1 - dm.mu) / n)
    assert (b["dropped"] == 0).all()                # P >= C_p (2 + 4 s) makes dropping rare
    on = (coefficients(dm, b) > 0.05).any(1)
    own = torch.nn.functional.one_hot(b["y"], dm.k).repeat_interleave(2, 1).bool()
    n_off = (on & ~own).sum(1).double()             # |V'| ~ Bin(2 (k - 1), s / k)
    trials, p = 2 * (dm.k - 1), dm.s / dm.k
    assert abs(n_off.mean() - trials * p) < 4 * math.sqrt(trials * p * (1 - p) / n)
    assert abs(n_off.var() - trials * p * (1 - p)) < 0.1 * trials * p * (1 - p)
    assert abs(torch.bincount(b["y"], minlength=dm.k).double() / n - 1 / dm.k).max() < 4 * math.sqrt(1 / dm.k / n)


@pytest.mark.parametrize("mu, eval_mu", [(0.0, 0.5), (0.05, None)])
def test_eval_splits_have_their_own_single_view_share(mu, eval_mu):
    """Training draws single-view samples with probability mu, val/test with eval_mu (default mu), so
    single-view accuracy can be measured on thousands of samples while the training share is tiny."""
    dm = MultiViewDataModule(k=4, d=16, P=10, s=1, mu=mu, eval_mu=eval_mu, num_pretrain=4000, num_val=4000,
                             num_test=4000)
    expected = {"train": mu, "val": mu if eval_mu is None else eval_mu, "test": mu if eval_mu is None else eval_mu}
    for split, p in expected.items():
        share = dm.full(split)["single_view"].double().mean()
        assert abs(share - p) <= 4 * math.sqrt(p * (1 - p) / 4000), (split, float(share), p)
    if eval_mu is not None:  # the other draws of a split do not depend on eval_mu
        plain = MultiViewDataModule(k=4, d=16, P=10, s=1, mu=mu, num_pretrain=4000, num_val=4000, num_test=4000)
        assert torch.equal(plain.full("test")["y"], dm.full("test")["y"])
        assert torch.equal(plain.full("train")["x"], dm.full("train")["x"])


def test_noise_std(dm):
    b = dm.full("train")
    z = coefficients(dm, b)
    on = (z > 0.03).any(-1)
    noise = b["x"][..., 2 * dm.k:]                  # coordinates orthogonal to every feature
    assert abs(noise[on].std() / dm.sigma_p - 1) < 0.02
    assert abs(noise[~on].std() / (dm.gamma * dm.k / math.sqrt(dm.d)) - 1) < 0.02
    alpha = z[~on]                                  # alpha ~ U[0, gamma] plus background noise
    assert abs(alpha.mean() - dm.gamma / 2) < 0.05 * dm.gamma


def test_samples_are_functions_of_seed_and_index(dm):
    index = torch.tensor([5, 2999, 17, 0])
    picked = dm.sample(index, "train")
    full = dm.full("train")
    for key in ("x", "y", "single_view"):
        assert torch.equal(picked[key], full[key][index])
    other = MultiViewDataModule(k=6, d=40, P=24, C_p=2, s=2.0, mu=0.3, sigma_p=0.004, gamma=0.001, seed=3)
    other.use_train_set("downstream")
    assert not torch.allclose(other.sample(index, "train")["x"], picked["x"])
    assert not torch.allclose(dm.sample(index, "test")["x"], picked["x"])


def test_features_that_do_not_fit_are_dropped_and_counted():
    dm = MultiViewDataModule(k=8, d=16, P=6, C_p=1, s=1.0, num_pretrain=4000, sigma_p=0.001, gamma=0.0005)
    b = dm.full("train")
    on = (coefficients(dm, b) > 0.03).any(1)                    # [B, 2k] features placed on patches
    own = torch.nn.functional.one_hot(b["y"], dm.k).repeat_interleave(2, 1).bool()
    assert on[own].all()                                         # own features are never dropped
    kept = on.sum(1)
    assert (kept <= dm.P).all()
    dropped = b["dropped"]
    assert (dropped > 0).any() and (kept[dropped > 0] == dm.P).all()   # drop only when every patch is used
    # dropped + kept off-class features ~ Bin(2 (k - 1), s / k)
    total_off = (kept - 2 + dropped).double()
    trials, p = 2 * (dm.k - 1), dm.s / dm.k
    assert abs(total_off.mean() - trials * p) < 4 * (trials * p * (1 - p) / len(total_off)) ** 0.5


@pytest.mark.parametrize("field,kwargs,needle", [
    ("d", dict(k=10, d=19), "at least 2k = 20"),
    ("P", dict(P=9, C_p=1, s=2.0), "C_p (2 + 4 s) = 10"),
    ("mu", dict(mu=1.5), "in [0, 1]"),
    ("basis", dict(basis="sphere"), "'identity' or 'random'"),
    ("rho", dict(rho=0.0), "in (0, 1]"),
])
def test_bad_config_names_field(field, kwargs, needle):
    with pytest.raises(ConfigError, match=rf"data\.{field}: must be .*") as err:
        MultiViewDataModule(**kwargs)
    assert needle in str(err.value)
