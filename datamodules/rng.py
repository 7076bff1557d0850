"""Counter-based random numbers: every value is a pure function of (seed, stream, sample index, counter).

Samples generated this way do not depend on batch size, worker count, device count or device, and are
produced directly on the device that holds ``index`` (no CPU bottleneck). The generator is a 32-bit
integer hash (xor-shift / multiply rounds) evaluated in int64 arithmetic, so it runs anywhere torch
does. Quality is ample for simulation; it is not a cryptographic generator.

Example:
    >>> idx = torch.arange(4)
    >>> a = normal(seed=0, stream=1, index=idx, shape=(3,))
    >>> b = normal(seed=0, stream=1, index=idx[2:], shape=(3,))
    >>> bool((a[2:] == b).all())
    True
"""
import math

import torch

_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """Bijective avalanche mix of 32-bit values held in int64, IN PLACE (callers pass temporaries):
    generation is memory-bound, and in-place ops halve the traffic."""
    x.bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(0x846CA68B).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def _key(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    base = _mix(torch.tensor((seed * 0x9E3779B1 + stream * 0x85EBCA77) & _MASK32, dtype=torch.int64))
    index = index.to(torch.int64)
    # Indices above 2**32 fold in their high word so long online streams never repeat.
    return _mix(_mix(base.to(index.device) ^ (index & _MASK32)) ^ (index >> 32))


def _bits(seed: int, stream: int, index: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    key = _key(seed, stream, index).unsqueeze(-1)
    counter = torch.arange(n, device=index.device, dtype=torch.int64)
    return _mix(_mix(key ^ counter).add_(key)).reshape(*index.shape, *shape)


def uniform(seed: int, stream: int, index: torch.Tensor, shape=(), dtype=torch.float32) -> torch.Tensor:
    """Uniform [0, 1) numbers of shape ``[*index.shape, *shape]`` with 24 random bits each."""
    return (_bits(seed, stream, index, tuple(shape)) >> 8).to(dtype).mul_(1.0 / (1 << 24))


def normal(seed: int, stream: int, index: torch.Tensor, shape=(), dtype=torch.float32) -> torch.Tensor:
    """Standard normal numbers (Box-Muller on two uniform streams)."""
    radius = uniform(seed, 2 * stream, index, shape, torch.float64).neg_().log1p_().mul_(-2.0).sqrt_()
    angle = uniform(seed, 2 * stream + 1, index, shape, torch.float64).mul_(2.0 * math.pi).cos_()
    return radius.mul_(angle).to(dtype)  # log1p(-u) with u < 1: no log(0)


def bernoulli(seed: int, stream: int, index: torch.Tensor, shape, p: float) -> torch.Tensor:
    """Boolean tensor, True with probability ``p``."""
    return uniform(seed, stream, index, shape, torch.float64) < p


def randint(seed: int, stream: int, index: torch.Tensor, shape, high: int) -> torch.Tensor:
    """Integers uniform on ``[0, high)``."""
    return (uniform(seed, stream, index, shape, torch.float64) * high).long().clamp_max(high - 1)


def permutation(seed: int, stream: int, index: torch.Tensor, n: int) -> torch.Tensor:
    """One uniformly random permutation of ``range(n)`` per index: shape ``[*index.shape, n]``."""
    # stable: equal keys (rare) are ordered by position, the same on every device
    return torch.argsort(uniform(seed, stream, index, (n,), torch.float64), dim=-1, stable=True)


def global_normal(seed: int, stream: int, shape, device=None, dtype=torch.float32) -> torch.Tensor:
    """Normal numbers that belong to no sample (dictionaries, feature bases), same on every device."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    return normal(seed, stream, index, tuple(shape), dtype)
