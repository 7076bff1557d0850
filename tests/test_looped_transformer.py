"""Dissertation Ch. 8 (the first piece): the looped masked linear attention with the chapter's weights is alpha times
gradient descent to float64 precision (Theorem 8.14), its error contracts at least as exp(-t / kappa) (Theorem
8.25), and kappa's sampling distribution at the chapter's Fig. 8.1 sizes."""
import math
import random

import pytest
import torch

from featlearn.theory.looped_transformer import (condition_number, gd_construction, gradient_descent,
                                                 looped_attention, prompt_matrix, step_size)


def _prompts(B: int, n: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(B, n, d, generator=gen, dtype=torch.float64)
    theta = torch.nn.functional.normalize(torch.randn(B, d, generator=gen, dtype=torch.float64), dim=1)
    alpha = 0.5 + 1.5 * torch.rand(B, generator=gen, dtype=torch.float64)
    return X, (X @ theta.unsqueeze(-1)).squeeze(-1), alpha, theta


@pytest.mark.parametrize("n, d, loops", [(16, 4, 1), (7, 3, 13), (33, 5, 200), (128, 4, 60)])
def test_the_loop_with_the_construction_is_alpha_times_gradient_descent(n, d, loops):
    seed = random.SystemRandom().randrange(1 << 31)
    X, y, alpha, _ = _prompts(5, n, d, seed)
    eta = step_size(X)
    gen = torch.Generator().manual_seed(seed + 1)
    q0 = torch.randn(5, d, generator=gen, dtype=torch.float64)  # any start: theta_0 = -q_0 / alpha
    out = looped_attention(prompt_matrix(X, y, alpha, q0), *gd_construction(d), eta, loops)
    gd = gradient_descent(X, y, eta, loops, theta0=-q0 / alpha[:, None])[-1]
    torch.testing.assert_close(-out[:, n, :d], alpha[:, None] * gd, rtol=1e-11, atol=1e-13, msg=f"seed {seed}")
    torch.testing.assert_close(out[:, :n], prompt_matrix(X, y, alpha)[:, :n], rtol=0, atol=0)  # examples untouched
    assert torch.equal(out[:, n, d], alpha)  # P's zero column: the query value stays


def test_other_weights_are_not_gradient_descent():
    X, y, alpha, _ = _prompts(3, 16, 4, 0)
    Q, P = gd_construction(4)
    out = looped_attention(prompt_matrix(X, y, alpha), 2 * Q, P, step_size(X), 5)  # twice the step
    gd = gradient_descent(X, y, step_size(X), 5)[-1]
    assert float((-out[:, 16, :4] - alpha[:, None] * gd).abs().max()) > 1e-3


@pytest.mark.parametrize("n", [16, 32, 64, 128])
def test_the_error_contracts_at_least_at_the_theorems_rate(n):
    # Theorem 8.25: ||theta_t - theta*||^2 <= exp(-t / kappa) ||theta_0 - theta*||^2 with eta = 1 / lambda_max
    X, y, _, theta = _prompts(10, n, 4, n)
    steps = gradient_descent(X, y, step_size(X), 200)
    ratio = (steps - theta).square().sum(-1) / theta.square().sum(-1)  # [201, 10]
    t = torch.arange(201, dtype=torch.float64).unsqueeze(1)
    bound = torch.exp(-t / condition_number(X))
    assert bool((ratio <= bound * (1 + 1e-9) + 1e-28).all())
    assert float(ratio[-1].max()) < 1e-20  # float64 reaches its floor well before T = 200 (log ratio ~ -70)


@pytest.mark.parametrize("n, mean", [(16, 4.82), (32, 2.83), (64, 2.03), (128, 1.63)])
def test_kappa_of_gaussian_prompts_at_fig_8_1_sizes(n, mean):
    # the mean condition number of X^T X, X 4 columns of n N(0,1) rows, over 4000 fresh draws against the means of
    # 20k draws (4.80, 2.82, 2.03, 1.64; the chapter's 10-trial averages 4.57, 3.13, 2.07, 1.62 are within their noise)
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(1 << 31))
    kappa = condition_number(torch.randn(4000, n, 4, generator=gen, dtype=torch.float64))
    se = float(kappa.std()) / math.sqrt(len(kappa))
    assert abs(float(kappa.mean()) - mean) < 5 * se + 0.01 * mean


def test_the_fig_8_1_experiment_writes_its_table(tmp_path):
    from featlearn.experiments import looped_transformer as experiment

    results = experiment.main(["--seed", "3", "--out", str(tmp_path)])
    for n in experiment.SIZES:
        r = results[3][n]
        assert r["gd_gap"] < 1e-12 and len(r["curve"]) == experiment.LOOPS + 1
        assert r["rate"] < r["bound_rate"] < 0  # faster than Theorem 8.25's bound, which is a bound
    assert "| n = 128 |" in (tmp_path / "looped_transformer.md").read_text()
    assert (tmp_path / "looped_transformer_curves.png").is_file()
