"""Ch. 5's closed forms (featlearn.theory.icl_scale) against what they claim: the population loss against Monte Carlo
of the attention's prediction, Theorem 5.4.1's rank-r optimum against brute-force minimisation over rank-r
factorisations, Theorem 5.4.2's evaluation loss against Monte Carlo with label noise, Theorem 5.4.3's gap against
the difference of two evaluation losses; expected_loss (any Gamma and task) against Theorem 5.4.2, the population
loss and Monte Carlo; bad values refused naming the field."""
import math

import pytest
import torch

from featlearn.errors import ConfigError
from featlearn.theory.icl_scale import (evaluation_loss, expected_loss, lsa_prediction, optimal_attention,
                                        optimal_scales, parity_heads, parity_output, population_loss, rank_gap)


def _spectrum(d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    lambdas = torch.sort(torch.rand(d, generator=gen, dtype=torch.float64) * 3 + 0.2, descending=True).values
    return Q, lambdas, gen


def _prompts(Q, lambdas, B, N, gen, w=None, sigma=0.0):
    """``B`` prompts of ``N`` examples, ``x ~ N(0, Q diag(lambdas) Q^T)``, their tasks, labels and queries."""
    root = Q * lambdas.sqrt()
    X = torch.randn(B, N, len(lambdas), generator=gen, dtype=torch.float64) @ root.T
    x_q = torch.randn(B, len(lambdas), generator=gen, dtype=torch.float64) @ root.T
    w = torch.randn(B, len(lambdas), generator=gen, dtype=torch.float64) if w is None else w.expand(B, -1)
    y = (X @ w.unsqueeze(-1)).squeeze(-1) + sigma * torch.randn(B, N, generator=gen, dtype=torch.float64)
    return X, y, x_q, (x_q * w).sum(-1)


def test_the_population_loss_is_the_attentions_mean_squared_error():
    Q, lambdas, gen = _spectrum(4, 1)
    Gamma = 0.1 * torch.randn(4, 4, generator=gen, dtype=torch.float64)
    losses = []
    for _ in range(10):  # 10 x 20,000 prompts of N = 6
        X, y, x_q, y_q = _prompts(Q, lambdas, 20000, 6, gen)
        losses.append((lsa_prediction(X, y, x_q, Gamma, 1.0, 6) - y_q) ** 2)
    err = torch.cat(losses)
    exact = float(population_loss(Gamma, Q @ torch.diag(lambdas) @ Q.T, 6))
    assert abs(float(err.mean()) - exact) < 4 * float(err.std()) / math.sqrt(len(err)), (float(err.mean()), exact)


@pytest.mark.parametrize("d, N, r, seed", [(5, 12, 1, 0), (5, 12, 2, 1), (6, 20, 3, 2), (4, 7, 4, 3)])
def test_theorem_5_4_1_is_the_best_rank_r_attention(d, N, r, seed):
    """Brute force: L-BFGS over Gamma = A^T B with A, B of r rows, from 5 random starts, never beats the closed form,
    and the best start reaches it (float64)."""
    Q, lambdas, gen = _spectrum(d, seed)
    Lambda = Q @ torch.diag(lambdas) @ Q.T
    U, u = optimal_attention(Q, lambdas, N, r, c=2.5)
    closed = float(population_loss(u * U, Lambda, N))
    assert torch.linalg.matrix_rank(U) == r
    best = math.inf
    for _ in range(5):
        A = torch.randn(r, d, generator=gen, dtype=torch.float64).requires_grad_()
        B = torch.randn(r, d, generator=gen, dtype=torch.float64).requires_grad_()
        opt = torch.optim.LBFGS([A, B], lr=1, max_iter=2000, tolerance_grad=1e-13, tolerance_change=1e-16,
                                line_search_fn="strong_wolfe")

        def loss():
            opt.zero_grad()
            value = population_loss(A.T @ B, Lambda, N)
            value.backward()
            return value
        opt.step(loss)
        found = float(population_loss(A.T @ B, Lambda, N).detach())
        assert found >= closed - 1e-10 * abs(closed)
        best = min(best, found)
    assert best == pytest.approx(closed, rel=1e-8)
    other = optimal_attention(Q, lambdas, N, r, c=-0.3)  # the scale c is free
    assert float(population_loss(other[1] * other[0], Lambda, N)) == pytest.approx(closed, rel=1e-12)


def test_theorem_5_4_2_is_the_evaluation_loss_with_label_noise():
    d, N, M, r, sigma = 5, 16, 8, 2, 0.7
    Q, lambdas, gen = _spectrum(d, 4)
    s = torch.tensor([0.8, -0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    xi = torch.tensor([0.0, 0.0, 0.6, 0.3, -0.4], dtype=torch.float64)
    U, u = optimal_attention(Q, lambdas, N, r)
    w = Q @ (s + xi)
    errs = []
    for _ in range(10):
        X, y, x_q, y_q = _prompts(Q, lambdas, 20000, M, gen, w=w, sigma=sigma)
        errs.append((lsa_prediction(X, y, x_q, U, u, M) - y_q) ** 2)  # rho = M at evaluation
    err = torch.cat(errs)
    exact = evaluation_loss(lambdas, optimal_scales(lambdas, N, r), s, xi, sigma, M)
    assert abs(float(err.mean()) - exact) < 4 * float(err.std()) / math.sqrt(len(err)), (float(err.mean()), exact)


def test_theorem_5_4_3_the_larger_rank_pays_more_for_label_noise():
    Q, lambdas, _ = _spectrum(6, 5)
    N, M, r, r2 = 20, 16, 2, 5
    s = torch.tensor([1.0, -0.7, 0, 0, 0, 0], dtype=torch.float64)  # a task inside the top r directions
    zero = torch.zeros(6, dtype=torch.float64)
    for sigma in (0.0, 0.5, 2.0):
        small = evaluation_loss(lambdas, optimal_scales(lambdas, N, r), s, zero, sigma, M)
        large = evaluation_loss(lambdas, optimal_scales(lambdas, N, r2), s, zero, sigma, M)
        assert large - small == pytest.approx(rank_gap(lambdas, s, sigma, N, M, r, r2), rel=1e-12)
        assert large > small
    gaps = [rank_gap(lambdas, s, sigma, N, M, r, r2) for sigma in (0.0, 0.5, 2.0)]
    assert gaps[0] < gaps[1] < gaps[2]  # the noisier the labels, the larger the gap


@pytest.mark.parametrize("gamma", [0.05, 0.2])
def test_theorem_5_5_1_heads_classify_their_pairs_with_margin_one(gamma):
    """d = 8 (nu2 = 3), k = 4 important features (nu1 = 2): the large model's 8 heads classify every pair of the 8
    features, the small model's 6 every pair of the 4 important ones, each query sign pattern with margin y g >= 1
    (= 1 at pairs one bit apart); the small model's heads are among the large model's, and it fails on a pair
    outside its features."""
    phi_i = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    phi_j = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    for nu in (2, 3):
        a, V = parity_heads(nu, gamma)
        assert a.shape == (2 * (nu + 1),) and V.shape == (2 * (nu + 1), 2 ** nu)
        margins = [phi_i * phi_j * parity_output(a, V, i, j, phi_i, phi_j, gamma)
                   for i in range(2 ** nu) for j in range(2 ** nu) if i != j]
        margins = torch.stack(margins)
        assert float(margins.min()) == pytest.approx(1.0, abs=1e-12), nu
    small, large = parity_heads(2, gamma), parity_heads(3, gamma)
    # the small model's bit heads are the large one's on the important features (their mirrors likewise)
    torch.testing.assert_close(small[1][:2], large[1][:2, :4], rtol=0, atol=0)
    a_small, V_small = small
    outside = torch.cat([V_small, torch.zeros(len(V_small), 4, dtype=torch.float64)], dim=1)  # features 5..8 unread
    g = parity_output(a_small, outside, 0, 6, phi_i, phi_j, gamma)
    assert float((phi_i * phi_j * g).min()) < 1  # a pair with an unimportant feature is not classified


@pytest.mark.parametrize("call, field", [
    (lambda lam: optimal_scales(lam, 10, 7), "r"),
    (lambda lam: optimal_scales(torch.tensor([1.0, 2.0], dtype=torch.float64), 10, 1), "lambdas"),
    (lambda lam: optimal_scales(torch.tensor([1.0, -0.5], dtype=torch.float64), 10, 1), "lambdas"),
    (lambda lam: rank_gap(lam, torch.zeros(3, dtype=torch.float64), -1.0, 10, 10, 1, 2), "sigma"),
    (lambda lam: rank_gap(lam, torch.zeros(3, dtype=torch.float64), 1.0, 10, 10, 2, 2), "r"),
    (lambda lam: optimal_attention(torch.eye(3, dtype=torch.float64), lam, 10, 1, c=0.0), "c"),
    (lambda lam: parity_heads(0, 0.1), "nu"),
    (lambda lam: parity_heads(2, 0.3), "gamma"),
])
def test_bad_values_are_refused_naming_the_field(call, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        call(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))



def _covariance(d: int, seed: int):
    Q, lam, _ = _spectrum(d, seed)
    return Q, lam, Q @ torch.diag(lam) @ Q.T


@pytest.mark.parametrize("sigma", [0.0, 0.7])
def test_expected_loss_is_theorem_5_4_2_on_the_optimum_and_the_population_loss_at_m_equals_n(sigma):
    Q, lam, Lam = _covariance(6, 1)
    v = optimal_scales(lam, N=20, r=3)
    s = torch.tensor([1.0, -2.0, 0.5, 0, 0, 0], dtype=torch.float64)
    xi = torch.tensor([0, 0, 0, 0.3, -1.0, 2.0], dtype=torch.float64)
    got = expected_loss(Q @ torch.diag(v) @ Q.T, Lam, 7, sigma, Q @ (s + xi))
    assert float(got) == pytest.approx(evaluation_loss(lam, v, s, xi, sigma, 7), rel=1e-12)
    Gamma = torch.randn(6, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)  # not symmetric
    assert float(expected_loss(Gamma, Lam, 20)) == pytest.approx(float(population_loss(Gamma, Lam, 20)), rel=1e-12)


def test_expected_loss_matches_monte_carlo_for_a_task_and_any_gamma():
    Q, lam, Lam = _covariance(5, 3)
    g = torch.Generator().manual_seed(4)
    Gamma = torch.randn(5, 5, generator=g, dtype=torch.float64)  # not symmetric
    w, M, sigma, B = torch.randn(5, generator=g, dtype=torch.float64), 6, 0.5, 400000
    x = torch.randn(B, M + 1, 5, generator=g, dtype=torch.float64) @ (Q * lam.sqrt()).T
    y = x @ w
    noisy = y[:, :M] + sigma * torch.randn(B, M, generator=g, dtype=torch.float64)
    h = torch.einsum("bn,bnd->bd", noisy, x[:, :M]) / M
    err = (torch.einsum("bd,de,be->b", h, Gamma, x[:, M]) - y[:, M]).square()
    exact = float(expected_loss(Gamma, Lam, M, sigma, w))
    assert abs(float(err.mean()) - exact) < 4 * float(err.std()) / B ** 0.5, (float(err.mean()), exact)


def test_expected_loss_refuses_bad_inputs():
    _, _, Lam = _covariance(3, 0)
    with pytest.raises(ConfigError, match="Lambda"):
        expected_loss(torch.eye(3, dtype=torch.float64), -Lam, 4)
    with pytest.raises(ConfigError, match="sigma"):
        expected_loss(torch.eye(3, dtype=torch.float64), Lam, 4, -1.0)
