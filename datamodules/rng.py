"""Counter-based random numbers: every value is a pure function of (seed, stream, sample index, counter).

Samples generated this way do not depend on batch size, worker count, device count or device, and are
produced directly on the device that holds ``index`` (no CPU bottleneck). The generator is a 32-bit
integer hash (two rounds of an xor-shift / multiply avalanche per value) evaluated in int32 arithmetic,
so it runs anywhere torch does. Quality is ample for simulation; it is not a cryptographic generator.

Speed (one CPU thread, 64 x 4096 values): ``normal`` 0.94 ms, ``uniform`` 0.51 ms; the int64 /
float64 / one-output Box-Muller version it replaced took 5.7 ms and 1.4 ms. ``uniform`` and everything
built on it return the same values as that version; ``normal`` does not (it now keeps both Box-Muller
outputs). Radii and angles are drawn as two contiguous blocks of words (the same words): with few values per
index, 5 for 2048 indices, ``normal`` takes 0.31 ms against 0.64 ms when it worked on the interleaved halves.

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


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """The avalanche of :func:`_mix` on 32-bit values held in int64, IN PLACE (for the per-index keys)."""
    x.bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(0x846CA68B).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """Bijective avalanche mix of 32-bit values held in int32, IN PLACE (callers pass temporaries).

    int32 halves the memory traffic of int64, and generation is memory-bound. Multiplications wrap
    modulo 2**32 (two's complement, as torch's CPU and CUDA kernels do); right shifts are made logical by
    masking the sign extension.
    """
    x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF)).mul_(0x7FEB352D)
    x.bitwise_xor_((x >> 15).bitwise_and_(0x1FFFF)).mul_(0x846CA68B - (1 << 32))
    return x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF))


def _mix_int(x: int) -> int:
    """:func:`_mix64` of one Python integer (the per-(seed, stream) base: no tensor ops for one number)."""
    x &= _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _lead(seed, index: torch.Tensor) -> tuple[int, ...]:
    """The leading shape of the numbers drawn for ``index``: ``index.shape``, behind a seed axis for a tensor
    of seeds."""
    return (len(seed), *index.shape) if torch.is_tensor(seed) else tuple(index.shape)


def _key(seed, stream: int, index: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per index, as int32; ``[S, *index.shape]`` for a 1-D tensor of ``S`` seeds (the keys each
    seed alone gives: the base is the same integer arithmetic, modulo 2^32)."""
    index = index.to(torch.int64)
    low = torch.bitwise_and(index, _MASK32)
    if torch.is_tensor(seed):
        base = _mix64(seed.to(device=index.device, dtype=torch.int64) * 0x9E3779B1 + stream * 0x85EBCA77)
        low = low ^ base.view(-1, *[1] * index.dim())
    else:
        low.bitwise_xor_(_mix_int(seed * 0x9E3779B1 + stream * 0x85EBCA77))
    # Indices above 2**32 fold in their high word so long online streams never repeat.
    key = _mix64(_mix64(low).bitwise_xor_(index >> 32))
    return (key - ((key >> 31) << 32)).to(torch.int32)


def _bits(seed, stream: int, index: torch.Tensor, n, blocks: int = 1) -> torch.Tensor:
    """``n`` random 32-bit words per index, shape ``[*lead, n]`` (int32; ``lead``: :func:`_lead`); with
    ``blocks``, counters ``0 .. blocks * n - 1`` laid out ``[blocks, *lead, n]`` (each block contiguous, same
    words).

    Two rounds, not one: with one, two samples whose keys differ in low bits only would see the same
    words at shifted counters (key ^ counter collides); adding the key after the first round and mixing
    again decorrelates them.
    """
    key = _key(seed, stream, index).unsqueeze(-1)
    counter = torch.arange(blocks * n, device=index.device, dtype=torch.int32)
    if blocks > 1:
        counter = counter.view(blocks, *([1] * (key.dim() - 1)), n)
    return _mix(_mix(key ^ counter).add_(key))


def _unit(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The top 24 bits of each word as a number in [0, 1) (exact in float32 and float64)."""
    return (bits >> 8).bitwise_and_(0xFFFFFF).to(dtype).mul_(1.0 / (1 << 24))


def uniform(seed, stream: int, index: torch.Tensor, shape=(), dtype=torch.float32) -> torch.Tensor:
    """Uniform [0, 1) numbers of shape ``[*index.shape, *shape]`` with 24 random bits each.

    Every sampler here takes ``seed`` as an int, or as a 1-D tensor of ``S`` seeds: then ``[S, ...]``, row ``s``
    bit for bit what seed ``seed[s]`` alone gives (the seeds of a stacked run drawn in one call).

    Example:
        >>> i = torch.arange(5)
        >>> both = uniform(torch.tensor([3, 4]), 1, i, (2,))
        >>> both.shape, bool(torch.equal(both[1], uniform(4, 1, i, (2,))))
        (torch.Size([2, 5, 2]), True)
    """
    return _unit(_bits(seed, stream, index, math.prod(shape)), dtype).reshape(*_lead(seed, index), *shape)


def normal(seed, stream: int, index: torch.Tensor, shape=(), dtype=torch.float32) -> torch.Tensor:
    """Standard normal numbers: Box-Muller, both outputs kept (cosine half, then sine half).

    Computed in float32 unless float64 is asked for: the inputs carry 24 bits, which float32 holds
    exactly, and the tails are bounded by them either way (|z| <= 5.8).
    """
    n = math.prod(shape)
    half = (n + 1) // 2
    work = torch.float64 if dtype == torch.float64 else torch.float32
    # words 0 .. half-1 of each index give radii, half .. 2 half-1 angles: computed as two contiguous blocks
    # (elementwise ops over a few values per index run many times faster on whole blocks)
    u = _unit(_bits(seed, stream, index, half, blocks=2), work)
    radius = u[0].neg_().log1p_().mul_(-2.0).sqrt_()  # log1p(-u) with u < 1: no log(0)
    angle = u[1].mul_(2.0 * math.pi)
    out = torch.stack((torch.cos(angle).mul_(radius), angle.sin_().mul_(radius)), dim=-2)
    lead = _lead(seed, index)
    out = out.view(*lead, 2 * half)[..., :n]
    return out.reshape(*lead, *shape).to(dtype)


def bernoulli(seed, stream: int, index: torch.Tensor, shape, p: float) -> torch.Tensor:
    """Boolean tensor, True with probability ``p``: ``uniform(...) < p`` for the same words, bit for bit.

    Compared as integers: with ``k`` a word's top 24 bits, ``k / 2^24 < p`` holds exactly when ``k < K =
    ceil(p 2^24)`` (``p 2^24`` is exact in float64), i.e. when the word read as unsigned is below ``256 K``;
    shifted by ``2^31`` that is one signed comparison, two passes where the float64 form took five.
    """
    return _below(_bits(seed, stream, index, math.prod(shape)).view(*_lead(seed, index), *shape), p)


def _below(bits: torch.Tensor, p: float) -> torch.Tensor:
    """``_unit(bits, float64) < p`` as one integer comparison (see :func:`bernoulli`); overwrites ``bits``."""
    top = math.ceil(p * (1 << 24)) if math.isfinite(p) else (1 << 24 if p > 0 else 0)  # NaN: as u < NaN, never
    if top <= 0 or top >= 1 << 24:  # no word, or every word, is below
        return torch.full(bits.shape, top > 0, dtype=torch.bool, device=bits.device)
    return bits.bitwise_xor_(-(1 << 31)) < (top << 8) - (1 << 31)


def randint(seed, stream: int, index: torch.Tensor, shape, high: int) -> torch.Tensor:
    """Integers uniform on ``[0, high)``."""
    return (uniform(seed, stream, index, shape, torch.float64) * high).long().clamp_max(high - 1)


def permutation(seed, stream: int, index: torch.Tensor, n: int) -> torch.Tensor:
    """One uniformly random permutation of ``range(n)`` per index: shape ``[*index.shape, n]``."""
    # stable: equal keys (rare) are ordered by position, the same on every device
    return torch.argsort(uniform(seed, stream, index, (n,), torch.float32), dim=-1, stable=True)


def global_normal(seed: int, stream: int, shape, device=None, dtype=torch.float32) -> torch.Tensor:
    """Normal numbers that belong to no sample (dictionaries, feature bases), same on every device."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    return normal(seed, stream, index, tuple(shape), dtype)


def global_orthonormal(seed: int, stream: int, rows: int, columns: int) -> torch.Tensor:
    """``[rows, columns]`` float64 with orthonormal columns drawn from :func:`global_normal`: the Q of its QR made
    unique (a positive R diagonal), so the same on every LAPACK and device."""
    q, r = torch.linalg.qr(global_normal(seed, stream, (rows, columns), dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


_FEISTEL_ROUNDS = 8  # 4 are far from uniform on the smallest domains (16 values: chi-square 550 for 29 dof)


def _feistel_keys(seed: int, stream: int) -> list[int]:
    words = _bits(seed, stream, torch.zeros((), dtype=torch.int64), _FEISTEL_ROUNDS)
    return [int(w) & _MASK32 for w in words.tolist()]


def _feistel(x: torch.Tensor, keys: list[int], half: int, inverse: bool) -> torch.Tensor:
    """A balanced Feistel network on ``2 * half``-bit integers (a bijection for any round function)."""
    mask = (1 << half) - 1
    left, right = x >> half, x & mask
    for key in (reversed(keys) if inverse else keys):
        if inverse:
            left, right = right ^ (_mix64(left + key) & mask), left
        else:
            left, right = right, left ^ (_mix64(right + key) & mask)
    return (left << half) | right


def index_permutation(seed: int, stream: int, index: torch.Tensor, n: int, inverse: bool = False) -> torch.Tensor:
    """``pi(index)`` for one random permutation ``pi`` of ``range(n)`` chosen by (seed, stream), or
    ``pi^-1(index)`` with ``inverse``, without materialising the permutation: an 8-round Feistel network on
    the smallest even-bit domain ``2^(2h) >= n``, cycle-walked back into ``range(n)`` (under 4 walks per value
    on average). For splits and orders of enumerations too large to hold (``p^k`` tuples).

    Example:
        >>> i = torch.arange(10)
        >>> pi = index_permutation(0, 5, i, 10)
        >>> sorted(pi.tolist()) == list(range(10)), bool((index_permutation(0, 5, pi, 10, inverse=True) == i).all())
        (True, True)
    """
    if n < 1 or n > 1 << 62:
        raise ValueError(f"n must be in [1, 2^62], got {n}")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _feistel_keys(seed, stream)
    out = index.to(torch.int64)
    walking = torch.ones_like(out, dtype=torch.bool)
    while bool(walking.any()):
        out = torch.where(walking, _feistel(out, keys, half, inverse), out)
        walking = out >= n
    return out
