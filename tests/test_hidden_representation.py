"""The hidden-representation linear model (Shi 2024, Eq. 7.6-7.8): structure, statistics, labels,
determinism and refusals."""
import math

import pytest
import torch

from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
from featlearn.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def _dm(**kw):
    base = dict(T=3, s=3, r=7, u=5, batch_size=64, sigma_S=1.3, sigma_R=0.7, sigma_U=2.0)
    base.update(kw)
    return HiddenRepresentationDataModule(**base)


def test_structure_and_views():
    dm = _dm()
    assert (dm.k, dm.d) == (3 + 3 * 4, 3 + 3 * 4 + 5)
    M = dm.M
    assert torch.allclose(M.t() @ M, torch.eye(dm.d, dtype=M.dtype), atol=1e-12)
    b = dm.sample(torch.arange(3000), "train")
    z, zp = b["x"].double() @ M, b["x_pos"].double() @ M                     # latents back through M^T
    R, U = dm.groups["R"], dm.groups["U"]
    assert torch.allclose(z[:, R], zp[:, R], atol=1e-5)                    # invariant part shared by the views
    assert (z[:, U] - zp[:, U]).abs().min() > 0                            # spurious part resampled
    for t in range(dm.T):                                                  # only the sample's own task is on
        rows = b["task"] == t
        for other in range(dm.T):
            block = z[rows][:, dm.groups["P"][other]].abs()
            assert (block.max() < 1e-5) == (other != t)


def test_statistics():
    dm, n = _dm(), 30000
    b = dm.sample(torch.arange(n), "train")
    z, zp = b["x"].double() @ dm.M, b["x_pos"].double() @ dm.M
    S, U = dm.groups["S"], dm.groups["U"]
    var = lambda a: float(a.var())  # noqa: E731
    # variances within 5 standard errors (sqrt(2/n) relative for a normal sample variance)
    for block, sigma, count in ((z[:, S], 1.3, n * 3), (z[:, U], 2.0, n * 5), (zp[:, U], 2.0, n * 5)):
        assert abs(var(block) - sigma ** 2) < 5 * sigma ** 2 * math.sqrt(2 / count)
    rows = b["task"] == 1
    priv = z[rows][:, dm.groups["P"][1]]
    assert abs(var(priv) - 0.49) < 5 * 0.49 * math.sqrt(2 / priv.numel())
    # z_U and z_U^+ independent; tasks uniform
    corr = float((z[:, U] * zp[:, U]).mean() / 4.0)
    assert abs(corr) < 5 / math.sqrt(n * 5)
    freq = torch.bincount(b["task"], minlength=3).double() / n
    assert (freq - 1 / 3).abs().max() < 5 * math.sqrt(2 / 9 / n)


def test_task_weights_and_use_tasks():
    dm = _dm(task_weights=[1.0, 3.0, 4.0])
    freq = torch.bincount(dm.sample(torch.arange(20000), "train")["task"], minlength=3).double() / 20000
    assert torch.allclose(freq, torch.tensor([0.125, 0.375, 0.5], dtype=torch.float64), atol=0.02)
    dm.use_tasks([2])
    assert (dm.sample(torch.arange(500), "train")["task"] == 2).all()
    with pytest.raises(ConfigError, match="tasks"):
        dm.use_tasks([3])


def test_labels():
    dm = _dm(label_noise=0.0, sigma_S=1.0, sigma_R=1.0)
    U = dm.label_vectors
    assert torch.allclose((U[:, :3] ** 2).sum(1), torch.full((3,), 0.5, dtype=U.dtype))  # v_{t,1} = 1/2
    assert torch.allclose((U[:, 3:] ** 2).sum(1), torch.full((3,), 0.5, dtype=U.dtype))  # v_{t,2} = 1/2
    for t in range(3):
        d = dm.labeled(t, torch.arange(20000), "test")
        z = d["z"].double()
        expect = z[:, :3] @ U[t, :3] + z[:, dm.groups["P"][t]] @ U[t, 3:]
        assert torch.allclose(d["y"].double(), expect, atol=1e-5)
        assert torch.allclose(d["x"].double(), z @ dm.M.t(), atol=1e-5)
        assert abs(float(d["y"].var()) - 1.0) < 0.05                       # v1 + v2 = 1 at sigma = 1
    noisy = _dm(label_noise=0.5, sigma_S=1.0, sigma_R=1.0).labeled(0, torch.arange(20000), "test")
    assert abs(float(noisy["y"].var()) - 1.25) < 0.06
    sign = _dm(label="sign").labeled(0, torch.arange(1000), "val")["y"]
    assert set(sign.unique().tolist()) == {-1.0, 1.0}


def test_determinism_nesting_and_splits():
    dm = _dm(num_val=12, num_test=30)
    a = dm.sample(torch.arange(5, 50), "train")
    b = dm.sample(torch.arange(0, 50), "train")
    assert torch.equal(a["x"], b["x"][5:]) and torch.equal(a["x_pos"], b["x_pos"][5:])
    assert torch.equal(dm.full("val")["x"], dm.labeled(0, torch.arange(12), "val")["x"])   # val = m target labels
    assert not torch.equal(dm.labeled(1, torch.arange(12), "val")["z"], dm.labeled(0, torch.arange(12), "val")["z"])
    assert not torch.equal(dm.labeled(0, torch.arange(12), "test")["z"], dm.labeled(0, torch.arange(12), "val")["z"])
    assert torch.equal(_dm(dictionary="identity").M, torch.eye(5 + 15, dtype=torch.float64))


@pytest.mark.parametrize("kw, field", [
    (dict(r=3), "data.r"), (dict(r=2), "data.r"), (dict(T=0), "data.T"), (dict(s=0), "data.s"),
    (dict(u=-1), "data.u"), (dict(target_task=3), "data.target_task"), (dict(task_weights=[1.0, 2.0]), "data.task_weights"),
    (dict(task_weights=[1.0, 0.0, 1.0]), "data.task_weights"), (dict(label_noise=-0.1), "data.label_noise"),
    (dict(sigma_U=0.0), "data.sigma_U"), (dict(label="probit"), "data.label"), (dict(dictionary="dct"), "data.dictionary"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ConfigError) as err:
        _dm(**kw)
    assert str(err.value).startswith(field)
