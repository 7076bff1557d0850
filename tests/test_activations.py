import math

import pytest
import torch

from featlearn.errors import ConfigError
from featlearn.kernels import Activation, smoothed_relu, smoothed_relu_derivative

ALL = [Activation("srelu", q=2, rho=0.3), Activation("srelu", q=3, rho=0.25), Activation("srelu", q=5, rho=1.7),
       Activation("relu"), Activation("pow", q=1), Activation("pow", q=2), Activation("pow", q=3)]


def _ids(a):
    return f"{a.name}-q{a.q}-rho{a.rho}"


def test_srelu_values_at_known_points():
    q, rho = 3, 0.5
    z = torch.tensor([-2.0, 0.0, 0.25, 0.5, 1.0, 3.0], dtype=torch.float64)
    # piecewise definition (Pan et al. 2023, Sec. 3.2): 0 / z^q/(q rho^(q-1)) / z - (1 - 1/q) rho
    expected = torch.tensor([0.0, 0.0, 0.25**3 / (3 * 0.25), 0.5 / 3, 1.0 - (2 / 3) * 0.5, 3.0 - (2 / 3) * 0.5],
                            dtype=torch.float64)
    torch.testing.assert_close(smoothed_relu(z, q, rho), expected, rtol=1e-15, atol=0)
    torch.testing.assert_close(Activation("srelu", q, rho)(z), expected, rtol=1e-15, atol=0)
    slope = torch.tensor([0.0, 0.0, 0.25, 1.0, 1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(smoothed_relu_derivative(z, q, rho), slope, rtol=1e-15, atol=0)


def test_relu_and_pow_values():
    z = torch.tensor([-2.0, -0.5, 0.0, 1.5], dtype=torch.float64)
    torch.testing.assert_close(Activation("relu")(z), torch.tensor([0.0, 0.0, 0.0, 1.5], dtype=torch.float64))
    torch.testing.assert_close(Activation("relu").derivative(z), torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64))
    # signed power: odd q keeps the sign, even q is even
    torch.testing.assert_close(Activation("pow", q=3)(z), torch.tensor([-8.0, -0.125, 0.0, 3.375], dtype=torch.float64))
    torch.testing.assert_close(Activation("pow", q=2)(z), torch.tensor([4.0, 0.25, 0.0, 2.25], dtype=torch.float64))
    torch.testing.assert_close(Activation("pow", q=3).derivative(z), torch.tensor([12.0, 0.75, 0.0, 6.75], dtype=torch.float64))
    torch.testing.assert_close(Activation("pow", q=1).derivative(z), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("act", ALL, ids=_ids)
def test_derivative_matches_autograd_float64(act):
    g = torch.Generator().manual_seed(11)
    z = (torch.randn(2001, generator=g, dtype=torch.float64) * 2 * act.rho).requires_grad_()
    z = z.detach()[z.detach().abs() > 1e-9].requires_grad_()  # avoid the relu kink at exactly 0
    (auto,) = torch.autograd.grad(act(z).sum(), z)
    torch.testing.assert_close(act.derivative(z.detach()), auto, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("act", ALL, ids=_ids)
def test_value_and_derivative_match_the_separate_forms(act, dtype):
    # the fallbacks' shared-work form: same values to rounding, input untouched
    g = torch.Generator().manual_seed(12)
    z = (torch.randn(3001, generator=g, dtype=torch.float64) * 2 * act.rho).to(dtype)
    before = z.clone()
    value, slope = act.value_and_derivative(z)
    assert torch.equal(z, before)
    tol = {torch.float32: 1e-6, torch.float64: 1e-14}[dtype]
    torch.testing.assert_close(value, act(z), rtol=tol, atol=tol * act(z).abs().max().item())
    torch.testing.assert_close(slope, act.derivative(z), rtol=tol, atol=tol)
    alone, none = act.value_and_derivative(z, slope=False)
    assert none is None and torch.equal(z, before)
    torch.testing.assert_close(alone, act(z), rtol=tol, atol=tol * act(z).abs().max().item())


@pytest.mark.parametrize("q,rho", [(2, 0.3), (3, 0.25), (4, 1.0), (7, 0.05)])
def test_srelu_continuity_at_rho_and_zero(q, rho):
    eps = 1e-9
    z = torch.tensor([rho - eps, rho, rho + eps], dtype=torch.float64)
    f, fp = smoothed_relu(z, q, rho), smoothed_relu_derivative(z, q, rho)
    assert abs(f[1].item() - rho / q) < 1e-15  # f(rho) = rho / q
    assert abs(fp[1].item() - 1.0) < 1e-15  # f'(rho) = 1
    assert abs(f[2].item() - f[0].item()) < 3 * eps  # value continuous (Lipschitz 1)
    assert abs(fp[2].item() - fp[0].item()) < 2 * q * eps / rho  # slope continuous (f'' <= (q-1)/rho)
    zero = torch.tensor([-1e-300, 0.0, 1e-300], dtype=torch.float64)
    assert smoothed_relu(zero, q, rho).abs().max().item() == 0.0  # f(0) = 0: masked patches add nothing
    slope0 = smoothed_relu_derivative(zero, q, rho)
    assert slope0[:2].abs().max().item() == 0.0 and 0.0 <= slope0[2].item() < 1e-299 / rho


@pytest.mark.parametrize("q", [2, 3, 5])
def test_srelu_homogeneity_below_rho(q):
    rho = 0.4
    g = torch.Generator().manual_seed(q)
    a = torch.rand(500, generator=g, dtype=torch.float64) * rho / 2
    for tau in (0.3, 1.5, 2.0):  # tau * a <= rho
        torch.testing.assert_close(smoothed_relu(tau * a, q, rho), tau**q * smoothed_relu(a, q, rho),
                                   rtol=1e-13, atol=0)
    # above rho the function is linear, not homogeneous: f(2 rho) != 2^q f(rho)
    big = torch.tensor([rho], dtype=torch.float64)
    assert not math.isclose(smoothed_relu(2 * big, q, rho).item(), 2**q * smoothed_relu(big, q, rho).item())


def test_activation_is_frozen_and_normalises_types():
    act = Activation("srelu", q=3, rho=1)
    assert isinstance(act.rho, float) and act.rho == 1.0
    with pytest.raises(AttributeError):
        act.q = 4  # type: ignore[misc]
    assert Activation("srelu", 3, 0.5) == Activation("srelu", 3, 0.5)


@pytest.mark.parametrize(
    "kwargs,field,fragment",
    [
        (dict(name="gelu"), "activation.name", "one of ('srelu', 'relu', 'pow')"),
        (dict(name="srelu", q=1), "activation.q", "integer >= 2 for srelu"),
        (dict(name="srelu", q=2.5), "activation.q", "integer >= 2 for srelu"),
        (dict(name="srelu", q=True), "activation.q", "integer >= 2"),
        (dict(name="pow", q=0), "activation.q", "integer >= 1 for pow"),
        (dict(name="srelu", rho=0.0), "activation.rho", "> 0"),
        (dict(name="srelu", rho=-1.0), "activation.rho", "> 0"),
        (dict(name="srelu", rho=float("nan")), "activation.rho", "finite"),
        (dict(name="srelu", rho="0.1"), "activation.rho", "> 0"),
    ],
)
def test_config_errors_name_the_field(kwargs, field, fragment):
    with pytest.raises(ConfigError) as info:
        Activation(**kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{field}: must be ") and fragment in msg, msg
    assert info.value.field == field
