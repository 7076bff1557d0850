"""Teacher-student and MAE objectives of Pan et al. 2023 (Sec. 3.2, App. H) against their closed forms over masks."""
import math
import typing

import pytest
import torch

from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.errors import ConfigError
from featlearn.kernels import Activation
from featlearn.lightning_modules.multiview_classifier import MultiViewClassifier
from featlearn.lightning_modules.multiview_encoder import MultiViewEncoder
from featlearn.lightning_modules.mrp import (MaskedAutoencoderMRP, TeacherStudentMRP, mae_expected_loss,
                                             mae_masked_loss, teacher_student_expected_loss,
                                             teacher_student_masked_loss)

ACT = Activation("srelu", q=3, rho=0.25)


def problem(seed=0, B=6, P=5, d=7, R=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, P, d, generator=g, dtype=torch.float64)
    w = (0.3 * torch.randn(R, d, generator=g, dtype=torch.float64)).requires_grad_()
    return x, w


def ts_parts(x, w, tau, mask=None):
    a = torch.einsum("bpd,rd->bpr", x, w)
    y = ACT(a)
    m = torch.ones(a.shape[:2], dtype=a.dtype) if mask is None else mask
    return (m[..., None] * y).sum(1), ACT(tau * a.detach()).sum(1), (y ** 2).sum(1)


@pytest.mark.parametrize("theta", [0.3, 0.5, 0.8])
def test_masked_loss_monte_carlo_mean_is_closed_form(theta):
    x, w = problem()
    tau, n = 1.7, 20000
    student, teacher, squares = ts_parts(x, w, tau)
    expected = teacher_student_expected_loss(student, teacher, squares, theta)
    g = torch.Generator().manual_seed(1)
    masks = (torch.rand(n, *x.shape[:2], generator=g) < theta).double()
    a = ACT(torch.einsum("bpd,rd->bpr", x, w)).detach()
    masked_student = torch.einsum("nbp,bpr->nbr", masks, a)
    losses = 0.5 * ((teacher - masked_student / theta) ** 2).sum(-1).mean(-1)   # one loss per mask
    torch.testing.assert_close(losses[7], teacher_student_masked_loss(masked_student[7], teacher, theta))
    stderr = losses.std() / n ** 0.5
    assert abs(losses.mean() - expected) < 5 * stderr
    assert stderr < 0.05 * expected                 # the check has power


def test_expected_gradient_matches_fact_2_1():
    x, w = problem(2)
    theta, tau = 0.4, 1.9
    student, teacher, squares = ts_parts(x, w, tau)
    loss = teacher_student_expected_loss(student, teacher, squares, theta)
    grad, = torch.autograd.grad(loss, w)
    a = torch.einsum("bpd,rd->bpr", x, w.detach())
    phi = (ACT(tau * a) - ACT(a)).sum(1)            # [B, R]
    coeff = (phi[:, None, :] - (1 / theta - 1) * ACT(a)) * ACT.derivative(a)
    fact = -torch.einsum("bpr,bpd->rd", coeff, x) / x.shape[0]
    torch.testing.assert_close(grad, fact, rtol=1e-10, atol=1e-12)


def test_loss_is_separable_over_kernels():
    x, w = problem(3)
    def grads(weights):
        s, t, q = ts_parts(x, weights, 1.5)
        return torch.autograd.grad(teacher_student_expected_loss(s, t, q, 0.5), weights)[0]
    w2 = w.detach().clone()
    w2[1] += 0.5
    g1, g2 = grads(w), grads(w2.requires_grad_())
    others = [0, 2, 3]
    torch.testing.assert_close(g1[others], g2[others], rtol=0, atol=0)
    assert not torch.allclose(g1[1], g2[1])


def test_mae_monte_carlo_mean_is_closed_form():
    x, w = problem(4, B=4, P=3, d=5, R=3)
    theta, n = 0.6, 20000
    act = Activation("srelu", q=4, rho=0.25)
    expected = mae_expected_loss(x, w.detach(), act, theta)
    assert expected > 0.1
    g = torch.Generator().manual_seed(5)
    masks = (torch.rand(n, *x.shape[:2], generator=g) < theta).double()
    w = w.detach()
    g = act((x * masks[..., None]) @ w.T) @ w / theta
    losses = 0.5 * ((x - g) ** 2).sum((2, 3)).mean(1)                          # one loss per mask
    torch.testing.assert_close(losses[3], mae_masked_loss(x, w, act, theta, masks[3]))
    assert abs(losses.mean() - expected) < 5 * losses.std() / n ** 0.5


def test_module_loss_uses_kernel_and_closed_form():
    dm = MultiViewDataModule(k=4, d=16, P=10, s=1, num_pretrain=12)
    model = TeacherStudentMRP(m=2, sigma0=0.3, backend="torch").attach(dm)
    batch = dm.full("train")
    x, w = batch["x"].double(), model.weight.detach().double().requires_grad_()
    s, t, q = ts_parts(x, w, model.tau())
    torch.testing.assert_close(model.loss(batch).double(), teacher_student_expected_loss(s, t, q, 0.5), rtol=1e-5, atol=1e-7)
    assert model.tau() == pytest.approx(1 + 0.5 / (dm.C_p * 0.5))


def test_sampled_mask_loss_masks_the_student_only():
    dm = MultiViewDataModule(k=4, d=16, P=10, s=1, num_pretrain=12)
    model = TeacherStudentMRP(m=2, sigma0=0.3, loss="mc", backend="torch").attach(dm)
    mask = dm.keep_mask(dm.full("train")["index"], step=0)          # the module asked the data for masks
    batch = dm.on_after_batch_transfer({"split": "train", "index": torch.arange(12)}, 0)
    torch.testing.assert_close(batch["mask"], mask, rtol=0, atol=0)
    assert 0 < mask.mean() < 1 and mask.shape == (12, dm.P)
    x, w = batch["x"].double(), model.weight.detach().double()
    masked_student, teacher, _ = ts_parts(x, w, model.tau(), mask.double())
    torch.testing.assert_close(model.loss(batch).double(), teacher_student_masked_loss(masked_student, teacher, 0.5),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cls,kwargs,field", [
    (TeacherStudentMRP, dict(theta=1.0), "model.theta"),
    (TeacherStudentMRP, dict(theta=0.0), "model.theta"),
    (TeacherStudentMRP, dict(q=2), "model.q"),
    (MultiViewClassifier, dict(q=1), "model.q"),
    (TeacherStudentMRP, dict(rho=0.0), "model.rho"),
    (MaskedAutoencoderMRP, dict(q=3), "model.q"),
    (TeacherStudentMRP, dict(loss="sampled"), "model.loss"),
    (TeacherStudentMRP, dict(backend="cuda"), "model.backend"),
    (TeacherStudentMRP, dict(norm_cap=0.0), "model.norm_cap"),
    (MultiViewClassifier, dict(head="mlp"), "model.head"),
    (MultiViewClassifier, dict(head="fixed", pretrained="x.ckpt"), "model.head"),
])
def test_bad_model_config_names_field(cls, kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}: must be"):
        cls(**kwargs)


def test_margin_is_negative_exactly_for_misclassified_samples():
    from featlearn.lightning_modules.multiview_classifier import classification_margin
    g = torch.Generator().manual_seed(7)
    logits, y = torch.randn(257, 5, generator=g, dtype=torch.float64), torch.randint(0, 5, (257,), generator=g)
    margin = classification_margin(logits, y)
    assert torch.equal(margin < 0, logits.argmax(1) != y)
    sorted_logits = logits.sort(1, descending=True).values
    best_other = torch.where(logits.argmax(1) == y, sorted_logits[:, 1], sorted_logits[:, 0])
    torch.testing.assert_close(margin, logits.gather(1, y[:, None]).squeeze(1) - best_other)


@pytest.mark.parametrize("options, needle", [
    ("--k 10 --d 10", "--d: must be at least 20"), ("--seed 1 1", "--seed: seeds must be distinct"),
    ("--seed -1", "--seed: must be a non-negative"), ("--P 5", "--P: must be at least 10"),
    ("--k 10 --N2 3", "--N2: must be at least 10"), ("--m 0", "--m: must be at least 1"),
    ("--mu 0.02 0.02", "--mu: values must be distinct"), ("--mu 1.5", "--mu: must be in [0, 1]"),
    ("--preset tiny tiny", "--preset: values must be distinct"), ("--k 3 --preset k8", "--k: give the size"),
    ("--preset k7", "--preset: invalid choice"), ("--threads 0", "--threads: must be at least 1"),
])
def test_experiment_refuses_bad_options_before_any_run(options, needle, capsys, tmp_path):
    from featlearn.experiments import mrp as experiment
    with pytest.raises(SystemExit) as exit_info:
        experiment.main([*options.split(), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()          # refused before the output folder is made


def _encoder_chain_fields():
    """Float arguments of each module, including those it forwards as ``**encoder`` to its parents."""
    for cls in (TeacherStudentMRP, MaskedAutoencoderMRP, MultiViewClassifier):
        names = {name for base in cls.__mro__ if "__init__" in vars(base) and issubclass(base, MultiViewEncoder)
                 for name, hint in typing.get_type_hints(base.__init__).items()
                 if any(getattr(part, "_type", None) is float for part in typing.get_args(hint) or (hint,))}
        yield from ((cls, name) for name in sorted(names))


@pytest.mark.parametrize("cls,name", list(_encoder_chain_fields()), ids=lambda v: getattr(v, "__name__", v))
def test_forwarded_float_arguments_refuse_nan(cls, name):
    """``**encoder`` forwarding keeps every inherited range checked from Python, with the same words."""
    with pytest.raises(ConfigError, match=rf"^model\.{name}: must be .*, got nan$"):
        cls(**{name: math.nan})


def test_each_module_trains_on_its_declared_set():
    dm = MultiViewDataModule(k=4, d=16, P=10, s=1, num_pretrain=12, num_downstream=8)
    TeacherStudentMRP(m=2).attach(dm)
    assert dm.train_set == "pretrain" and len(dm.full("train")["x"]) == 12
    MultiViewClassifier(m=2).attach(dm)
    assert dm.train_set == "downstream" and len(dm.full("train")["x"]) == 8
    with pytest.raises(ConfigError, match=r"^data\.batch_size: must be at most data\.num_downstream = 8"):
        MultiViewClassifier(m=2).attach(MultiViewDataModule(k=4, d=16, P=10, s=1, num_downstream=8, batch_size=10))


@pytest.mark.parametrize("change, needle", [
    ({"shared": {"q": "three", "sigma0": 0.02, "lr_scale": 1.0}}, "experiment.yaml: shared.q: "),
    ({"grids": {"q": [3]}}, "experiment.yaml: grids.q: must be a known field"),
])
def test_experiment_settings_are_typed(change, needle):
    """``configs/mrp/experiment.yaml`` is read into dataclasses: a wrong type or an unknown field is refused,
    naming the field."""
    from dataclasses import asdict
    from featlearn.experiments import mrp as experiment
    from featlearn.experiments.study import load_settings
    assert experiment.grid_points() == [{"q": 3, "lr_scale": s} for s in (0.5, 1.0, 2.0)]
    with pytest.raises(ConfigError) as refused:
        load_settings("experiment.yaml", experiment.Settings, {**asdict(experiment.SETTINGS), **change})
    assert str(refused.value).startswith(needle)
