"""The representation spectrum (featlearn.metrics.spectrum): ranks of planted low-rank representations, the
nuclear norm's gradient against autograd of torch.linalg.svdvals, and the callback writing both ranks to
TensorBoard during a run of a method that has a representation (and nothing for one that has none)."""
import glob

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from featlearn.cli import make_cli
from featlearn.metrics.spectrum import effective_rank, nuclear_norm, stable_rank
from tiny_sizes import HIDDEN, MODADD, VIT, over


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_ranks_of_a_planted_low_rank_representation(rank):
    g = torch.Generator().manual_seed(rank)
    basis, _ = torch.linalg.qr(torch.randn(24, rank, generator=g, dtype=torch.float64))
    F = torch.randn(20000, rank, generator=g, dtype=torch.float64) @ basis.T  # isotropic in a rank-r subspace
    # equal variances: both ranks are r up to the sample's spread (singular values within ~1% at n = 20000)
    assert stable_rank(F) == pytest.approx(rank, rel=0.05)
    assert effective_rank(F) == pytest.approx(rank, rel=0.01)
    skewed = F @ torch.diag(torch.linspace(1.0, 0.1, 24, dtype=torch.float64))
    assert stable_rank(skewed) < stable_rank(F) + 1e-9  # unequal scales: fewer effective directions
    assert stable_rank(torch.ones(10, 4)) == 0.0  # one point: the centred features are 0


def test_nuclear_norm_gradient_matches_autograd_of_svdvals():
    g = torch.Generator().manual_seed(0)
    F = torch.randn(13, 7, generator=g, dtype=torch.float64, requires_grad=True)
    ours = torch.autograd.grad(nuclear_norm(F), F)[0]
    reference = torch.autograd.grad(torch.linalg.svdvals(F).sum(), F)[0]
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)
    assert float(nuclear_norm(F)) == pytest.approx(float(torch.linalg.svdvals(F).sum()), rel=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nuclear_norm_gradient_is_the_minimum_norm_subgradient_where_rank_deficient(dtype):
    """At F = 0 the subgradient set is the unit spectral-norm ball: the gradient is its minimum-norm element 0
    (ERM-NU's theory model starts at w = 0), not U V^T of whatever singular vectors the solver picked. At rank r
    it is U_r V_r^T of the nonzero part, whatever the zero singular values' vectors."""
    zero = torch.zeros(9, 5, dtype=dtype, requires_grad=True)
    assert torch.equal(torch.autograd.grad(nuclear_norm(zero), zero)[0], torch.zeros(9, 5, dtype=dtype))
    g = torch.Generator().manual_seed(1)
    for shape, rank in (((13, 7), 3), ((6, 11), 2), ((8, 8), 1)):
        left, _ = torch.linalg.qr(torch.randn(shape[0], rank, generator=g, dtype=torch.float64))
        right, _ = torch.linalg.qr(torch.randn(shape[1], rank, generator=g, dtype=torch.float64))
        s = torch.linspace(3.0, 0.5, rank, dtype=torch.float64)
        F = ((left * s) @ right.T).to(dtype).requires_grad_()
        want = (left @ right.T).to(dtype)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(torch.autograd.grad(nuclear_norm(F), F)[0], want, rtol=0, atol=tol)


def _run(tmp_path, config, sizes, name):
    cli = make_cli(["--config", f"configs/{config}", *sizes, "--trainer.max_steps", "4",
                    "--trainer.enable_progress_bar", "false", "--spectrum.every_n_steps", "2",
                    "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.name", name],
                   run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    events = EventAccumulator(glob.glob(str(tmp_path / name / "version_*"))[0])
    events.Reload()
    return cli.model, events.Tags()["scalars"], events


def test_callback_logs_both_ranks_for_a_method_with_a_representation(tmp_path):
    model, tags, events = _run(tmp_path, "universality/universal.yaml", HIDDEN, "spectrum")
    for tag in ("val/stable_rank", "val/effective_rank"):
        assert tag in tags
        steps = [e.step for e in events.Scalars(tag)]
        assert steps == [2, 4]
        assert all(1.0 <= e.value <= model.w.shape[0] for e in events.Scalars(tag))


def test_the_contrastive_vit_logs_the_spectrum_of_its_pooled_representation(tmp_path):
    model, tags, events = _run(tmp_path, "vit/cl.yaml", over(dict(VIT, K=4, d=None)), "vit_cl")
    ranks = [e.value for e in events.Scalars("val/stable_rank")]
    assert len(ranks) == 2 and all(1.0 <= r <= model.V.shape[1] for r in ranks)
    batch = model.trainer.datamodule.batch(torch.arange(6), "val")
    assert tuple(model.representation(batch).shape) == (6, model.V.shape[1])


def test_callback_skips_a_method_without_one(tmp_path):
    _, tags, _ = _run(tmp_path, "modular_addition/mlp.yaml", MODADD, "none")
    assert "val/stable_rank" not in tags
