"""Shi 2024, Ch. 7: the exact projection onto {||W||_2 <= 1, ||W||_F <= sqrt(r)}, the losses, the closed forms,
contrastive regularisation, the LinearContrastive module (a small universal run reaches c_{P_t} = 1/T, CR its
closed form) and the configs through the CLI."""
import math
from pathlib import Path

import pytest
import torch

from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
from featlearn.errors import ConfigError
from featlearn.experiments.common import build
from featlearn.lightning_modules.contrastive_regularization import ContrastiveRegularization, trust_region_
from featlearn.lightning_modules.universality import LinearContrastive, contrastive_loss
from featlearn.theory.universality import (closed_form_representation, column_norms, contrastive_loss_closed_form,
                                           group_means, layout, predicted_column_norms, private_overlap,
                                           project_bisection, project_spectral_frobenius, project_trust_region)
from featlearn.theory.universality_downstream import downstream_errors, linear_cka, norm_constrained_fit, ridge_fit
from featlearn.theory.universality_downstream import ridge_loo_errors

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


def _feasible(P, r2, tol=1e-9):
    return float(torch.linalg.matrix_norm(P, 2)) <= 1 + tol and float((P ** 2).sum()) <= r2 * (1 + tol)


# ----------------------------------------------------------------------------------------------
# projection
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, scale, r2", [((7, 11), 2.0, 3.0), ((13, 5), 0.9, 2.0), ((9, 9), 5.0, 4.5),
                                              ((6, 10), 0.5, 3.0), ((8, 3), 3.0, 100.0)])
def test_projection_kkt(shape, scale, r2):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    W = scale * torch.randn(*shape, generator=g, dtype=torch.float64)
    P = project_spectral_frobenius(W, r2)
    assert _feasible(P, r2)
    # KKT form: same singular vectors, p_i = min(1, sigma_i / (1 + tau)), tau >= 0, tau (||P||_F^2 - r) = 0
    U, sig, Vh = torch.linalg.svd(W, full_matrices=False)
    p = torch.linalg.svdvals(P)
    assert torch.allclose(U.t() @ P @ Vh.t(), torch.diag(p), atol=1e-9)
    free = (p < 1 - 1e-9) & (sig > 1e-9)
    ratio = sig[free] / p[free]
    assert torch.allclose(ratio, ratio[:1].expand_as(ratio), rtol=1e-9) if free.any() else True
    tau = float(ratio[0]) - 1 if free.any() else 0.0
    assert tau >= -1e-12
    assert abs(tau * (float((P ** 2).sum()) - r2)) < 1e-8
    assert ((p >= 1 - 1e-9) <= (sig / (1 + tau) >= 1 - 1e-9)).all()  # capped values are those above the cap
    # the variational inequality of a projection: <W - P, Q - P> <= 0 for feasible Q
    for _ in range(20):
        Q = project_spectral_frobenius(torch.randn(*shape, generator=g, dtype=torch.float64) * 3, r2)
        assert float(((W - P) * (Q - P)).sum()) <= 1e-9
    # against an independent reference (the multiplier by bisection instead of the exact search)
    assert torch.allclose(P, project_bisection(W, r2), atol=1e-10)


def _trust_region_by_multiplier(W, ref, gamma, onto_class):
    """An independent reference: by Lagrange duality the projection is onto_class((W + mu W*) / (1 + mu)) with the
    multiplier mu >= 0 of the ball (||P(mu) - W*|| decreases in mu), found by bisection."""
    P = lambda mu: onto_class((W + mu * ref) / (1 + mu))  # noqa: E731
    dist = lambda mu: float(torch.linalg.matrix_norm(P(mu) - ref))  # noqa: E731
    if dist(0.0) <= gamma:
        return P(0.0)
    lo, hi = 0.0, 1.0
    while dist(hi) > gamma:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if dist(mid) > gamma else (lo, mid)
    return P(hi)


@pytest.mark.parametrize("shape, gamma, cap", [((7, 11), 0.4, None), ((9, 6), 1.5, None), ((8, 8), 0.7, 3.0)])
def test_trust_region_projection_is_exact(shape, gamma, cap):
    """Dykstra's projection onto {||W||_2 <= 1 [, ||W||_F^2 <= cap]} n {||W - W*||_F <= gamma}: feasible, equal to
    the multiplier form's projection (an independent computation), strictly nearer W than clipping-then-scaling
    (alternating) where they differ, and the variational inequality <W - P, Q - P> <= 0 against feasible points Q
    built independently (convex combinations of W* and class points, inside the ball)."""
    g = torch.Generator().manual_seed(sum(shape))
    rand = lambda scale: scale * torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    onto_class = lambda a: project_spectral_frobenius(a, cap or 1.0, frobenius=cap is not None)  # noqa: E731
    ref = onto_class(rand(0.6))
    worst = 0.0
    for _ in range(4):
        W = ref + rand(1.0)
        P = project_trust_region(W, ref, gamma, radius2=cap)
        assert float(torch.linalg.matrix_norm(P, 2)) <= 1 + 1e-9
        assert float(torch.linalg.matrix_norm(P - ref)) <= gamma * (1 + 1e-6)
        assert cap is None or float((P ** 2).sum()) <= cap * (1 + 1e-9)
        for _ in range(30):
            C = onto_class(rand(2.0))
            t = min(1.0, gamma / float(torch.linalg.matrix_norm(C - ref))) * float(torch.rand((), generator=g))
            Q = ref + t * (C - ref)
            worst = max(worst, float(((W - P) * (Q - P)).sum()))
        assert torch.allclose(P, _trust_region_by_multiplier(W, ref, gamma, onto_class), atol=1e-6)
        alternating = ref + (onto_class(W) - ref) * min(1.0, gamma / float(torch.linalg.matrix_norm(onto_class(W) - ref)))
        assert float(torch.linalg.matrix_norm(W - P)) < float(torch.linalg.matrix_norm(W - alternating)) - 1e-3
    assert worst <= 1e-6, worst
    C = onto_class(rand(1.0))
    inside = ref + 0.5 * gamma * (C - ref) / float(torch.linalg.matrix_norm(C - ref))  # in both sets: kept
    assert torch.allclose(project_trust_region(inside, ref, gamma, radius2=cap), inside, atol=1e-8)


def test_norm_constrained_fit_kkt():
    """argmin_{||u|| <= B} ||F u - y||^2: inside the ball it is least squares (zero gradient); on the sphere the
    gradient points inward along u (F^T (F u - y) = -mu u, mu >= 0), for wide and tall F."""
    g = torch.Generator().manual_seed(5)
    for m, k in ((12, 5), (6, 9)):
        F = torch.randn(m, k, generator=g, dtype=torch.float64)
        y = F @ torch.randn(k, generator=g, dtype=torch.float64) + 0.1 * torch.randn(m, generator=g, dtype=torch.float64)
        free = norm_constrained_fit(F, y, 1e6)
        assert torch.allclose(free, torch.linalg.lstsq(F, y[:, None], driver="gelsd").solution[:, 0], atol=1e-8)
        for bound in (0.3, 0.5 * float(free.norm())):
            u = norm_constrained_fit(F, y, bound)
            assert abs(float(u.norm()) - bound) < 1e-8
            grad = F.t() @ (F @ u - y)
            mu = -float(grad @ u) / bound ** 2
            assert mu >= 0 and torch.allclose(grad, -mu * u, atol=1e-7)
    with pytest.raises(ConfigError, match="bound"):
        norm_constrained_fit(F, y, 0.0)


def test_projection_is_a_projection():
    g = torch.Generator().manual_seed(3)
    A, B = (torch.randn(9, 13, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    PA, PB = project_spectral_frobenius(A, 5.0), project_spectral_frobenius(B, 5.0)
    assert torch.allclose(project_spectral_frobenius(PA, 5.0), PA, atol=1e-10)       # idempotent
    assert float((PA - PB).norm()) <= float((A - B).norm()) + 1e-10                   # non-expansive
    inside = 0.3 * A / torch.linalg.matrix_norm(A, 2)
    assert torch.allclose(project_spectral_frobenius(inside, 5.0), inside, atol=1e-12)  # exact on points inside
    spectral_only = project_spectral_frobenius(A, 5.0, frobenius=False)
    assert torch.allclose(torch.linalg.svdvals(spectral_only), torch.linalg.svdvals(A).clamp(max=1.0), atol=1e-10)
    assert project_spectral_frobenius(A.float(), 5.0).dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# losses and closed forms
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["theory", "triplet", "pca", "infonce"])
def test_losses_against_float64_formulas(loss):
    g = torch.Generator().manual_seed(1)
    f, fp = torch.randn(13, 5, generator=g, dtype=torch.float64), torch.randn(13, 5, generator=g, dtype=torch.float64)
    sp = lambda t: torch.log1p(torch.exp(-t))  # noqa: E731
    ref = {"theory": sp((f * (fp - f.mean(0))).sum(1)).mean(), "triplet": sp((f * (fp - f.roll(1, 0))).sum(1)).mean(),
           "pca": -(f * fp).sum(1).mean(),
           "infonce": (-torch.diagonal(torch.log_softmax(f @ fp.t() / 0.1, 1))).mean()}[loss]
    assert torch.allclose(contrastive_loss(f, fp, loss), ref, rtol=1e-12)
    assert torch.allclose(contrastive_loss(f.float(), fp.float(), loss).double(), ref, rtol=1e-4, atol=1e-5)


def test_loss_closed_form_matches_monte_carlo_of_the_data():
    """The population loss at the closed-form universal W* equals E l(c_S Z + c_P Z_t) (within MC error)."""
    dm = HiddenRepresentationDataModule(T=3, s=3, r=6, u=4)
    W = closed_form_representation(dm.groups, dm.M, predicted_column_norms("universal", 3, 3, 6)).float()
    b = dm.sample(torch.arange(60000), "train")
    # the batch-mean negative is ~0 at this size: compare with the analytic E phi(x^-) = 0
    measured = float(torch.nn.functional.softplus(-((b["x"] @ W.t()) * (b["x_pos"] @ W.t())).sum(1)).mean())
    theory = contrastive_loss_closed_form(1.0, [1 / 3] * 3, 3, 6)
    assert abs(measured - theory) < 0.01 * theory + 3e-3 / math.sqrt(6)
    assert contrastive_loss_closed_form(1.0, [1.0], 3, 6, loss="pca") == -6.0
    with pytest.raises(ValueError):
        contrastive_loss_closed_form(1.0, [1.0], 3, 6, loss="infonce")


def test_predicted_column_norms_and_closed_form_representation():
    assert predicted_column_norms("universal", 8, 5, 10) == {"S": 1.0, **{f"P{t}": 0.125 for t in range(8)}, "U": 0.0}
    spec = predicted_column_norms("specific", 3, 5, 10, target=2)
    assert (spec["P2"], spec["P0"], spec["S"]) == (1.0, 0.0, 1.0)
    cr = predicted_column_norms("cr", 4, 5, 10, gamma=1.0)
    assert math.isclose(cr["P0"], (0.5 + 1 / math.sqrt(5)) ** 2) and cr["P1"] == 0.25   # (1/2 + 1/sqrt 5)^2 = 0.897
    assert predicted_column_norms("cr", 4, 5, 10, gamma=10.0)["P0"] == 1.0               # capped by ||W||_2 <= 1
    with pytest.raises(ConfigError, match="gamma"):
        predicted_column_norms("cr", 4, 5, 10, gamma=0.0)
    g = layout(T=3, s=2, r=5, u=3)
    M = torch.linalg.qr(torch.randn(g["d"], g["d"], dtype=torch.float64))[0]
    W = closed_form_representation(g, M, predicted_column_norms("universal", 3, 2, 5))
    c = group_means(column_norms(W, M), g)
    assert c == pytest.approx({"S": 1.0, "P0": 1 / 3, "P1": 1 / 3, "P2": 1 / 3, "U": 0.0}, abs=1e-12)
    assert _feasible(W, 5.0, 1e-9) and math.isclose(float((W ** 2).sum()), 5.0)   # on the boundary of the class


def test_ridge_loo_and_cka():
    g = torch.Generator().manual_seed(5)
    F, y = torch.randn(17, 4, generator=g, dtype=torch.float64), torch.randn(17, generator=g, dtype=torch.float64)
    for lam in (1e-3, 0.3):
        loo = []
        for i in range(17):
            keep = torch.arange(17) != i  # the held-out fit keeps the full-set penalty lam * m (ridge_fit: its own m)
            loo.append(float((F[i] @ ridge_fit(F[keep], y[keep], lam * 17 / 16) - y[i]) ** 2))
        assert math.isclose(float(ridge_loo_errors(F, y, [lam])[0]), sum(loo) / 17, rel_tol=1e-9)
    X = torch.randn(40, 6, generator=g, dtype=torch.float64)
    assert math.isclose(linear_cka(X, X), 1.0) and linear_cka(X, torch.randn(40, 6, generator=g, dtype=torch.float64)) < 0.5
    # nested label sets: repeats x max(m) rows are needed
    with pytest.raises(ConfigError):
        downstream_errors(F, y, F, y, [10], repeats=2)


def test_trust_region():
    g = torch.Generator().manual_seed(2)
    ref = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    params = {k: v + torch.randn(v.shape, generator=g) for k, v in ref.items()}
    far = {k: v.clone() for k, v in params.items()}
    scale = trust_region_(far, ref, 0.5)
    dist = math.sqrt(sum(float(((far[k] - ref[k]) ** 2).sum()) for k in ref))
    assert scale < 1 and math.isclose(dist, 0.5, rel_tol=1e-5)
    near = {k: ref[k] + 0.01 * (params[k] - ref[k]) for k in ref}
    kept = {k: v.clone() for k, v in near.items()}
    assert trust_region_(near, ref, 10.0) == 1.0 and all(torch.equal(near[k], kept[k]) for k in ref)
    cr = ContrastiveRegularization(lam=0.1, gamma=None)
    assert float(cr.loss(torch.tensor(2.0), torch.tensor(5.0))) == pytest.approx(2.5)
    assert cr.project_(params) == 1.0                       # no trust region without gamma
    with pytest.raises(ConfigError, match="gamma"):
        ContrastiveRegularization(gamma=0.0)
    with pytest.raises(ConfigError, match="lam"):
        ContrastiveRegularization(lam=-1.0)


# ----------------------------------------------------------------------------------------------
# the module
# ----------------------------------------------------------------------------------------------
def _train(model, dm, steps, batch=1024):
    opt = model.configure_optimizers()
    for step in range(steps):
        b = dm.sample(torch.arange(step * batch, (step + 1) * batch), "train")
        loss = model.training_step(b, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.finish_step(step + 1)
    return model


def test_gradient_matches_the_closed_form():
    """d/dW of the theory loss with the batch-mean negative, against the hand-derived gradient."""
    dm = HiddenRepresentationDataModule(T=2, s=2, r=3, u=3, batch_size=16)
    model = LinearContrastive(init_scale=0.3).attach(dm)
    model.w.data = model.w.data.double()
    b = dm.sample(torch.arange(16), "train")
    x, xp = b["x"].double(), b["x_pos"].double()
    loss = model.training_step({"x": x, "x_pos": xp}, 0)
    loss.backward()
    W = model.w.detach()
    f, fp = x @ W.t(), xp @ W.t()
    fbar = f.mean(0)
    t = (f * (fp - fbar)).sum(1)
    a = -torch.sigmoid(-t) / len(x)                              # l'(t) / B
    # t_i = f_i . fp_i - f_i . fbar: d/df_i = fp_i - fbar - (1/B) sum_j a_j f_j / a_i ... assembled as matrices
    gf = a[:, None] * (fp - fbar) - (a[:, None] * f).sum(0, keepdim=True) / len(x)
    gfp = a[:, None] * f
    grad = gf.t() @ x + gfp.t() @ xp
    assert torch.allclose(model.w.grad, grad, rtol=1e-10, atol=1e-12)


def test_small_universal_run_reaches_one_over_T():
    """T = 4, s = 3, r = 6, u = 4, 300 projected SGD steps of 1024 pairs: c_{P_t} within 0.05 of 1/T for every
    task (measured: within 0.01), c_S ~ 1, c_U ~ 0; W on the class boundary."""
    dm = HiddenRepresentationDataModule(T=4, s=3, r=6, u=4, batch_size=1024, num_val=8, num_test=200)
    model = _train(LinearContrastive(mode="universal", lr=0.5, probe_repeats=2).attach(dm), dm, 300)
    c = model.column_norms()
    assert all(abs(c[f"P{t}"] - 0.25) < 0.05 for t in range(4)), c
    assert abs(c["S"] - 1) < 0.02 and c["U"] < 0.02, c
    assert abs(float((model.w.detach().double() ** 2).sum()) - 6.0) < 1e-4
    assert float(torch.linalg.matrix_norm(model.w.detach().double(), 2)) <= 1 + 1e-5


def test_cr_reaches_its_closed_form_and_the_cap_breaks_it():
    """CR from the closed-form universal W* at T = 4, s = 3, r = 6, gamma = 0.5: c_{P_target} ->
    (1/2 + 0.5/sqrt 3)^2 = 0.618, other tasks stay 1/4. With the Frobenius cap kept (an ablation) the target
    cannot reach it and the other tasks lose weight."""
    dm = HiddenRepresentationDataModule(T=4, s=3, r=6, u=4, batch_size=1024, num_val=8, num_test=200)
    model = _train(LinearContrastive(mode="cr", gamma=0.5, lr=0.5, probe_repeats=2).attach(dm), dm, 150)
    c, theory = model.column_norms(), (0.5 + 0.5 / math.sqrt(3)) ** 2
    assert abs(c["P0"] - theory) < 0.02, (c, theory)
    assert all(abs(c[f"P{t}"] - 0.25) < 0.01 for t in (1, 2, 3)) and abs(c["S"] - 1) < 0.01
    assert float(model.cr.distance({"w": model.w})) <= 0.5 + 1e-5
    capped = _train(LinearContrastive(mode="cr", gamma=0.5, lr=0.5, probe_repeats=2, cr_frobenius_cap=True).attach(dm),
                    dm, 150).column_norms()
    assert capped["P0"] < theory - 0.05 and max(capped[f"P{t}"] for t in (1, 2, 3)) < 0.24, capped


def test_cr_from_an_overlapping_universal_optimum_takes_from_the_other_task():
    """The universal loss never sees two tasks' private features together, so a W* whose private directions are
    shared is optimal too (same column norms, private overlap 1). From such a W* the spectral cap makes the
    target's gain the other task's loss: the theory's "the rest is kept" needs overlap 0 (T = 2, s = 3, r = 6)."""
    dm = HiddenRepresentationDataModule(T=2, s=3, r=6, u=2, batch_size=1024, num_val=8, num_test=200)
    g = dm.groups
    closed = closed_form_representation(g, dm.M, predicted_column_norms("universal", 2, 3, 6))
    A = closed @ dm.M                                   # rows = representation units; P1 reuses P0's units
    p0, p1 = g["P"][0], g["P"][1]
    A[p0[:, None], p1[None, :]] = A[p1[:, None], p1[None, :]]
    A[p1[:, None], p1[None, :]] = 0
    shared = A @ dm.M.t()
    assert float(torch.linalg.matrix_norm(shared, 2)) <= 1 + 1e-9
    assert group_means(column_norms(shared, dm.M), g) == pytest.approx(group_means(column_norms(closed, dm.M), g))
    assert private_overlap(shared, dm.M, g) == pytest.approx(1.0) and private_overlap(closed, dm.M, g) < 1e-9
    ends = {}
    for name, w_star in (("closed", closed), ("shared", shared)):
        model = LinearContrastive(mode="cr", gamma=1.0, lr=0.5, probe_repeats=2).attach(dm)
        with torch.no_grad():
            model.w.copy_(w_star)
        model.cr.anchor({"w": model.w})
        ends[name] = _train(model, dm, 150).column_norms()
    assert ends["closed"]["P0"] > 0.95 and abs(ends["closed"]["P1"] - 0.5) < 0.01, ends
    assert ends["shared"]["P1"] < 0.4, ends


def test_specific_mode_trains_on_the_target_only():
    dm = HiddenRepresentationDataModule(T=3, s=3, r=6, u=4, target_task=2, batch_size=512, num_val=8, num_test=200)
    LinearContrastive(mode="specific").attach(dm)
    assert dm.tasks == [2]
    dm2 = HiddenRepresentationDataModule(T=3, s=3, r=6, u=4, batch_size=512, num_val=8, num_test=200)
    LinearContrastive(mode="universal").attach(dm2)
    assert dm2.tasks == [0, 1, 2]


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="model.gamma"):
        LinearContrastive(mode="cr", gamma=0.0)
    with pytest.raises(ConfigError, match="model.reference"):
        LinearContrastive(mode="universal", reference="x.ckpt")
    with pytest.raises(ConfigError, match="model.reference"):
        LinearContrastive(mode="cr", reference=str(tmp_path / "missing.ckpt"))
    with pytest.raises(ConfigError, match="model.loss"):
        LinearContrastive(loss="hinge")
    with pytest.raises(ConfigError, match="model.lr"):
        LinearContrastive(lr=-1.0)


@pytest.mark.parametrize("config", ["universal", "specific", "cr", "infonce"])
def test_every_mode_runs_through_the_cli(config, tmp_path):
    cli = build(f"universality/{config}.yaml", tmp_path, config, "--trainer.max_steps", "3",
                "--data.init_args.batch_size", "128", "--data.init_args.num_test", "100",
                "--model.init_args.probe_repeats", "2", "--trainer.log_every_n_steps", "1")
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 3
    metrics = cli.model.final_metrics()
    assert math.isfinite(metrics["downstream_target_mse"]) and "c_p_target" in metrics
    logged = set(cli.trainer.logged_metrics)  # the project's scheme: <section>/<name>, lower case
    assert {"train/loss", "theory/c_p_target", "theory/c_p_target_closed_form", "train/weight_spectral_norm"} <= logged
    assert all(t.split("/")[0] in ("train", "theory") and t.islower() and t.count("/") == 1 for t in logged), logged
    assert Path(cli.trainer.checkpoint_callback.last_model_path).is_file()
    if config == "universal":  # a universal checkpoint is a CR reference
        ref = cli.trainer.checkpoint_callback.last_model_path
        cr = build("universality/cr.yaml", tmp_path, "cr_ref", "--trainer.max_steps", "2",
                   "--data.init_args.batch_size", "128", "--data.init_args.num_test", "100",
                   "--model.init_args.probe_repeats", "2", "--model.init_args.reference", ref)
        cr.trainer.fit(cr.model, cr.datamodule)
        assert torch.allclose(cr.model.cr.ref_w, cli.model.w.detach())
