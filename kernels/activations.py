"""Pointwise activations of the patch encoder: smoothed ReLU (Pan et al. 2023, Sec. 3.2), ReLU and the power z**q.

The smoothed ReLU with integer degree ``q >= 2`` and threshold ``rho > 0`` is

    f(z)  = clamp(z, 0, rho)**q / (q * rho**(q-1)) + max(z - rho, 0)
    f'(z) = (clamp(z, 0, rho) / rho)**(q-1)

i.e. 0 below 0, the polynomial z**q / (q rho**(q-1)) on [0, rho] and the line z - (1 - 1/q) rho above
rho; value (rho/q) and slope (1) are continuous at rho. ``relu`` is max(z, 0) with derivative 1[z > 0].
``pow`` is the plain integer power z**q on the whole real line (odd q keeps the sign of z, even q is
even), derivative q z**(q-1).

Example:
    >>> import torch
    >>> act = Activation("srelu", q=3, rho=0.5)
    >>> act(torch.tensor([-1.0, 0.5, 2.0]))
    tensor([0.0000, 0.1667, 1.6667])
    >>> act.derivative(torch.tensor([0.25, 1.0]))
    tensor([0.2500, 1.0000])
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from featlearn.errors import ConfigError

ACTIVATIONS = ("srelu", "relu", "pow")


def smoothed_relu(z: torch.Tensor, q: int, rho: float) -> torch.Tensor:
    """Smoothed ReLU of Pan et al. 2023, Sec. 3.2 (branch-free form), differentiable with autograd.

    Example:
        >>> smoothed_relu(torch.tensor([0.0, 0.1, 1.0]), q=2, rho=0.2)
        tensor([0.0000, 0.0250, 0.9000])
    """
    c = z.clamp(0.0, rho)
    return c.pow(q) / (q * rho ** (q - 1)) + (z - rho).clamp_min(0.0)


def smoothed_relu_derivative(z: torch.Tensor, q: int, rho: float) -> torch.Tensor:
    """f'(z) = (clamp(z, 0, rho) / rho)**(q-1): 0 below 0, 1 above rho.

    Example:
        >>> smoothed_relu_derivative(torch.tensor([-1.0, 0.1, 3.0]), q=3, rho=0.2)
        tensor([0.0000, 0.2500, 1.0000])
    """
    return (z.clamp(0.0, rho) / rho).pow(q - 1)


@dataclass(frozen=True)
class Activation:
    """An elementwise activation, validated on construction (``ConfigError`` naming the field).

    Args:
        name: ``"srelu"`` (smoothed ReLU), ``"relu"`` or ``"pow"`` (z**q).
        q: integer degree; srelu needs q >= 2, pow q >= 1 (ignored by relu, but must be an int >= 1).
        rho: srelu threshold, > 0 (ignored by relu and pow, but must be finite and > 0).

    Example:
        >>> Activation("relu")(torch.tensor([-2.0, 3.0]))
        tensor([0., 3.])
        >>> Activation("pow", q=3).derivative(torch.tensor([-2.0]))
        tensor([12.])
        >>> Activation("srelu", q=1)
        Traceback (most recent call last):
        featlearn.errors.ConfigError: activation.q: must be an integer >= 2 for srelu, got 1
    """

    name: str = "srelu"
    q: int = 3
    rho: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ConfigError("activation.name", f"one of {ACTIVATIONS}", self.name)
        q_ok = isinstance(self.q, numbers.Integral) and not isinstance(self.q, bool)
        q_min = 2 if self.name == "srelu" else 1
        if not q_ok or self.q < q_min:
            raise ConfigError("activation.q", f"an integer >= {q_min} for {self.name}", self.q)
        rho_ok = isinstance(self.rho, numbers.Real) and not isinstance(self.rho, bool)
        if not rho_ok or not math.isfinite(float(self.rho)) or self.rho <= 0:
            raise ConfigError("activation.rho", "a finite number > 0", self.rho)
        object.__setattr__(self, "q", int(self.q))
        object.__setattr__(self, "rho", float(self.rho))

    @property
    def kind(self) -> int:
        """Integer id used by the Triton kernels (0 srelu, 1 relu, 2 pow)."""
        return ACTIVATIONS.index(self.name)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.name == "srelu":
            return smoothed_relu(z, self.q, self.rho)
        if self.name == "relu":
            return z.clamp_min(0.0)
        return z.pow(self.q)

    def value_and_derivative(self, z: torch.Tensor, slope: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(f(z), f'(z))`` (``f'`` None unless ``slope``), sharing the clamp / power between the two and
        working in place on its own temporaries, so not for autograd: the fused fallbacks use it.

        Example:
            >>> f, df = Activation("srelu", q=3, rho=0.5).value_and_derivative(torch.tensor([0.25, 1.0]))
            >>> f, df
            (tensor([0.0208, 0.6667]), tensor([0.2500, 1.0000]))
        """
        if self.name == "srelu":  # f = c (c/rho)^(q-1) / q + max(z - rho, 0) with c = clamp(z, 0, rho)
            c = z.clamp(0.0, self.rho)
            linear = (z - self.rho).clamp_min_(0.0)
            if not slope:
                return c.pow_(self.q).mul_(1.0 / (self.q * self.rho ** (self.q - 1))).add_(linear), None
            d = (c * (1.0 / self.rho)).pow_(self.q - 1)
            return c.mul_(d).mul_(1.0 / self.q).add_(linear), d
        if not slope:  # relu, pow: the value alone is one pass
            return self(z), None
        if self.name == "relu":
            return z.clamp_min(0.0), (z > 0).to(z.dtype)
        lower = z.pow(self.q - 1)
        return z * lower, lower.mul_(self.q)

    def derivative(self, z: torch.Tensor) -> torch.Tensor:
        """Elementwise f'(z) (for relu, 0 at z = 0)."""
        if self.name == "srelu":
            return smoothed_relu_derivative(z, self.q, self.rho)
        if self.name == "relu":
            return (z > 0).to(z.dtype)
        if self.q == 1:
            return torch.ones_like(z)
        return self.q * z.pow(self.q - 1)
