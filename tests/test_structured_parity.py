"""F_Xi sampler (Shi 2024, Sec. 2.3): statistics against the closed forms, exact structure, determinism,
variants and refusals naming the field."""
import math

import pytest
import torch

from featlearn.datamodules.structured_parity import StructuredParityDataModule
from featlearn.errors import ConfigError
from featlearn.theory.two_layer import data_constants

N = 40000


def _dm(**kw):
    base = dict(dim=60, num_patterns=40, k=5, num_train=64, batch_size=16, num_val=8, num_test=8)
    base.update(kw)
    return StructuredParityDataModule(**base)


def _phi(dm, x):
    """The hidden vector back from x: phi = M^T x sigma~ + E phi (M has orthonormal columns)."""
    c = dm.constants
    mean = torch.full((dm.num_patterns,), c["mean_bg"], dtype=torch.float64)
    mean[dm.relevant] = c["mean_A"]
    return x.double() @ dm.dictionary * math.sqrt(c["sigma2"]) + mean


def test_parity_main_setting_statistics():
    """E[y] = 0, gamma = 1/4, sigma~^2 = D/4 (from the mixture's definition), each within 5 standard errors."""
    dm = _dm(dim=120, num_patterns=100, p_o=0.5)
    assert dm.constants["gamma"] == pytest.approx(0.25) and dm.constants["sigma2"] == pytest.approx(25.0)
    b = dm.sample(torch.arange(N), "train")
    x, y = b["x"].double(), b["y"].double()
    phi = _phi(dm, x)
    assert (phi - phi.round()).abs().max() < 1e-4 and set(phi.round().unique().tolist()) <= {0.0, 1.0}
    phi = phi.round()
    se = 1 / math.sqrt(N)
    assert abs(y.mean()) < 5 * se
    rel = phi[:, dm.relevant]
    gamma = (y[:, None] * rel).mean(0) - y.mean() * rel.mean(0)
    assert (gamma - 0.25).abs().max() < 5 * 0.5 * se
    assert abs(phi.var(0).sum() - 25.0) < 0.02 * 25
    # x normalised with the analytic moments: mean 0 and E||x||^2 = 1
    assert x.mean(0).abs().max() < 5 * se and abs(x.pow(2).sum(1).mean() - 1) < 0.01
    # labels: the parity of S = sum_A phi_j; D^(1) has phi_A all zeros or all ones
    s = rel.sum(1)
    assert torch.equal(s.long(), b["s"]) and torch.equal(y, (s % 2) * 2 - 1)
    d1 = b["c"] == 1
    assert abs(d1.double().mean() - 0.5) < 5 * se
    assert set(s[d1].tolist()) == {0.0, 5.0}
    # background patterns have marginal p_o, independent of the component's mixing
    bg = torch.ones(dm.num_patterns, dtype=torch.bool)
    bg[dm.relevant] = False
    assert (phi[:, bg].mean(0) - 0.5).abs().max() < 5 * 0.5 * se


def test_background_rate_p_o():
    dm = _dm(p_o=0.2)
    b = dm.sample(torch.arange(N), "train")
    phi = _phi(dm, b["x"]).round()
    bg = torch.ones(dm.num_patterns, dtype=torch.bool)
    bg[dm.relevant] = False
    assert abs(phi[:, bg].mean() - 0.2) < 5 * math.sqrt(0.16 / (N * bg.sum()))
    assert dm.constants["gamma"] == pytest.approx((1 - 0.2) / 2)
    assert abs(phi.var(0).sum() - dm.constants["sigma2"]) < 0.03 * dm.constants["sigma2"]


def test_no_structure_is_uniform():
    dm = _dm(structure=False)
    b = dm.sample(torch.arange(N), "train")
    phi = _phi(dm, b["x"]).round()
    assert (phi.mean(0) - 0.5).abs().max() < 5 * 0.5 / math.sqrt(N)
    rel = phi[:, dm.relevant]
    y = b["y"].double()
    assert ((y[:, None] * rel).mean(0)).abs().max() < 5 * 0.5 / math.sqrt(N)   # gamma = 0
    assert dm.constants["gamma"] == pytest.approx(0.0, abs=1e-12)


def test_interval_constants_and_labels():
    dm = _dm(k=30, labeling="interval")
    c = dm.constants
    assert c["prob_pos"] == pytest.approx(0.585, abs=1e-3) and c["gamma"] == pytest.approx(0.068, abs=1e-3)
    assert c["sigma2"] == pytest.approx(30 * 2 / 9 + 10 / 4)
    b = dm.sample(torch.arange(N), "train")
    assert torch.equal(b["y"] > 0, (b["s"] >= 20) & (b["s"] <= 30))
    assert abs((b["y"] > 0).double().mean() - c["prob_pos"]) < 5 * 0.5 / math.sqrt(N)


@pytest.mark.parametrize("neg", [0.8, 0.9])
def test_class_imbalance_keeps_the_class_conditionals(neg):
    dm, base = _dm(neg_fraction=neg), _dm()
    b, b0 = dm.sample(torch.arange(N), "train"), base.sample(torch.arange(N), "train")
    assert abs((b["y"] < 0).double().mean() - neg) < 5 * math.sqrt(neg * (1 - neg) / N)
    for label in (-1, 1):  # S | y unchanged: sub-sampling a class
        hist = torch.bincount(b["s"][b["y"] == label], minlength=6).double()
        hist0 = torch.bincount(b0["s"][b0["y"] == label], minlength=6).double()
        assert (hist / hist.sum() - hist0 / hist0.sum()).abs().max() < 0.03


def test_hypercube_mog():
    dm = _dm(dim=100, num_patterns=4, k=4, labeling="hypercube_mog", normalize="none")
    b = dm.sample(torch.arange(N), "train")
    coef = b["x"].double() @ dm.dictionary                                  # eps_i + noise along M_i
    noise_std = math.sqrt(4 / 100)
    signs = torch.sign(coef)
    assert ((coef - signs).abs() < 6 * noise_std).all()
    assert torch.equal(b["y"], signs.prod(1).to(b["y"].dtype))
    assert abs(b["x"].double().pow(2).sum(1).mean() - dm.constants["sigma2"]) < 0.02 * dm.constants["sigma2"]
    # the 2^k centres: every sample is nearest its own cluster's centre, whose parity is the label
    centres = dm.centres
    assert centres.shape == (16, 100) and _dm().centres is None
    nearest = (b["x"].double()[:2000] @ centres.T).argmax(1)
    assert torch.equal((centres[nearest] @ dm.dictionary).round(), signs[:2000])


def test_samples_are_functions_of_seed_split_index():
    dm = _dm()
    full = dm.sample(torch.arange(50), "train")
    part = dm.sample(torch.tensor([49, 3, 17]), "train")
    assert torch.equal(part["x"], full["x"][[49, 3, 17]])
    assert not torch.equal(dm.sample(torch.arange(50), "test")["x"], full["x"])
    assert not torch.equal(_dm(seed=1).sample(torch.arange(50), "train")["x"], full["x"])
    m = dm.dictionary
    assert torch.allclose(m.T @ m, torch.eye(dm.num_patterns, dtype=m.dtype), atol=1e-12)
    assert torch.equal(_dm().dictionary, m) and torch.equal(_dm().relevant, dm.relevant)


def test_full_batch_steps_then_minibatches():
    dm = _dm(num_train=64, batch_size=16)
    dm.use_full_batch_steps(2)
    assert dm.full_batch_steps == 2
    with pytest.raises(ConfigError, match="^data.mode"):
        _dm(mode="online").use_full_batch_steps(2)


@pytest.mark.parametrize("kw, field", [
    (dict(k=4), "data.k"), (dict(p_o=0.6), "data.p_o"), (dict(p_o=0.0), "data.p_o"), (dict(k=50), "data.k"),
    (dict(dim=30), "data.dim"), (dict(labeling="hypercube_mog"), "data.num_patterns"),
    (dict(k=30, labeling="interval", interval_high=31), "data.interval_high"),
    (dict(k=30, labeling="interval", interval_low=25, interval_high=20), "data.interval_low"),
    (dict(neg_fraction=1.0), "data.neg_fraction"), (dict(labeling="xor"), "data.labeling"),
    (dict(mog_noise=-1.0), "data.mog_noise"),
])
def test_bad_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(ConfigError) as info:
        _dm(**kw)
    assert info.value.field == field, str(info.value)


def test_theory_constants_match_hand_computed_numbers():
    c = data_constants("parity", 5, 100, 0.5)
    assert (c["gamma"], c["sigma2"], c["mean_y"]) == pytest.approx((0.25, 25.0, 0.0))
