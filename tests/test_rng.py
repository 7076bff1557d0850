"""The counter-based RNG: stated statistics, and values that depend only on (seed, stream, index)."""
import math

import pytest
import torch

from featlearn.datamodules import rng


def test_uniform_and_normal_moments():
    index = torch.arange(3001)
    u = rng.uniform(5, 1, index, (333,), torch.float64).flatten()
    n = u.numel()
    assert 0 <= u.min() and u.max() < 1
    # mean 1/2 and variance 1/12 within 5 standard errors
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    z = rng.normal(5, 2, index, (333,), torch.float64).flatten()
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs((z ** 4).mean() - 3) < 5 * math.sqrt(96 / n)
    # no correlation between neighbouring counters or neighbouring indices
    zz = rng.normal(5, 2, index, (333,), torch.float64)
    assert abs((zz[:, 1:] * zz[:, :-1]).mean()) < 5 / math.sqrt(n)
    assert abs((zz[1:] * zz[:-1]).mean()) < 5 / math.sqrt(n)


def test_values_depend_only_on_seed_stream_index():
    index = torch.tensor([0, 17, 2**33 + 5, 123456789])
    full = rng.normal(3, 4, index, (5, 7))
    for i in range(len(index)):
        assert torch.equal(rng.normal(3, 4, index[i:i + 1], (5, 7))[0], full[i])
    assert not torch.equal(rng.normal(4, 4, index, (5, 7)), full)
    assert not torch.equal(rng.normal(3, 5, index, (5, 7)), full)
    assert not torch.equal(full[2], rng.normal(3, 4, torch.tensor([5]), (5, 7))[0])  # high word counts


def test_bernoulli_randint_permutation():
    index = torch.arange(20011)
    b = rng.bernoulli(0, 9, index, (), 0.3).double()
    assert abs(b.mean() - 0.3) < 5 * math.sqrt(0.21 / len(index))
    r = rng.randint(0, 10, index, (), 7)
    counts = torch.bincount(r, minlength=7).double()
    assert r.min() == 0 and r.max() == 6
    assert ((counts - len(index) / 7).abs() < 5 * math.sqrt(len(index) / 7)).all()
    perm = rng.permutation(0, 11, index[:500], 9)
    assert torch.equal(perm.sort(1).values, torch.arange(9).expand(500, 9))
    first = torch.bincount(perm[:, 0], minlength=9).double()
    assert ((first - 500 / 9).abs() < 5 * math.sqrt(500 / 9)).all()


@pytest.mark.parametrize("p", [0.5, 0.3, 1 / 3, 0.1, 1e-7, 1 - 1e-7, 5 / (1 << 24), 5.5 / (1 << 24), 0.0, 1.0, 1.5,
                               -0.2, 0.999999, math.inf, -math.inf, math.nan])
def test_bernoulli_is_the_uniform_below_p(p):
    """The integer comparison is the float64 one it replaced, ``uniform < p``, word for word, at thresholds on
    and between the 2^-24 grid, at the ends and past them; with a seed tensor too."""
    index = torch.arange(40009) - 7
    for seed in (5, torch.tensor([5, -2, 9])):
        got = rng.bernoulli(seed, 3, index, (3,), p)
        assert got.dtype == torch.bool and torch.equal(got, rng.uniform(seed, 3, index, (3,), torch.float64) < p)
    # every word at the comparison's edge: the top 24 bits k near ceil(p 2^24), and the lowest and highest
    # word of each (the low 8 bits must not matter), plus random words
    edge = math.ceil(min(max(p, 0.0), 1.0) * (1 << 24)) if math.isfinite(p) else 0
    k = torch.arange(edge - 3, edge + 4).clamp(0, (1 << 24) - 1)
    unsigned = torch.cat([k << 8, (k << 8) + 255, torch.randint(0, 1 << 32, (5000,))])
    words = (unsigned - ((unsigned >> 31) << 32)).to(torch.int32)
    assert torch.equal(rng._below(words.clone(), p), rng._unit(words.clone(), torch.float64) < p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_global_normal_is_fixed(dtype):
    a = rng.global_normal(1, 2, (3, 4), dtype=dtype)
    assert a.dtype == dtype and torch.equal(a, rng.global_normal(1, 2, (3, 4), dtype=dtype))


def _python_word(seed: int, stream: int, index: int, counter: int) -> int:
    """The generator's 32-bit word in plain Python integers: the reference for its int32 arithmetic."""
    def mix(x):
        x &= 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    base = mix((seed * 0x9E3779B1 + stream * 0x85EBCA77) & 0xFFFFFFFF)
    key = mix(mix(base ^ (index & 0xFFFFFFFF)) ^ (index >> 32))
    return mix((mix(key ^ counter) + key) & 0xFFFFFFFF)


def test_words_match_unsigned_32_bit_arithmetic():
    # the int32 kernels rely on wrapping multiplies and masked shifts; check them against exact integers
    index = [0, 1, 2**31 - 1, 2**31 + 3, 2**33 + 5]
    u = rng.uniform(7, 3, torch.tensor(index), (11,), torch.float64)
    for i, ix in enumerate(index):
        for c in range(11):
            assert u[i, c].item() == (_python_word(7, 3, ix, c) >> 8) / 2**24


@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3)])
def test_normal_is_box_muller_of_its_words(shape):
    """Value c of an index: radius from word c mod h, angle from word h + c mod h (h = half the count, rounded
    up), cosine for the first h values, sine after: checked against exact integer words, float64."""
    index = [3, 2**31 + 7, 2**33 + 1]
    z = rng.normal(5, 9, torch.tensor(index), shape, torch.float64).reshape(len(index), -1)
    count = z.shape[1]
    half = (count + 1) // 2
    for i, ix in enumerate(index):
        for c in range(count):
            j = c % half
            u_r, u_a = ((_python_word(5, 9, ix, w) >> 8) / 2 ** 24 for w in (j, half + j))
            radius, angle = math.sqrt(-2 * math.log1p(-u_r)), 2 * math.pi * u_a
            want = radius * (math.cos(angle) if c < half else math.sin(angle))
            assert z[i, c].item() == pytest.approx(want, rel=1e-13, abs=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_keeps_both_box_muller_outputs_independent(dtype):
    index = torch.arange(4001)
    z = rng.normal(1, 6, index, (3, 41), dtype)  # odd count: the last sine output is dropped
    assert z.dtype == dtype and z.shape == (4001, 3, 41)
    flat = z.flatten(1).double()
    half = (flat.shape[1] + 1) // 2
    cos_half, sin_half = flat[:, : flat.shape[1] - half], flat[:, half:]
    n = cos_half.numel()
    assert abs((cos_half * sin_half).mean()) < 5 / math.sqrt(n)  # a pair's two outputs are uncorrelated
    assert abs((cos_half ** 2 * sin_half ** 2).mean() - 1) < 5 * math.sqrt(8 / n)  # ... and independent
    for part in (cos_half, sin_half):
        assert abs(part.mean()) < 5 / math.sqrt(n) and abs(part.var() - 1) < 5 * math.sqrt(2 / n)
    assert z.abs().max() < 5.8  # 24-bit inputs bound the tails


@pytest.mark.parametrize("sampler, args", [
    (rng.uniform, ((3, 2), torch.float64)), (rng.normal, ((5,),)), (rng.normal, ((4,), torch.float64)),
    (rng.bernoulli, ((7,), 0.3)), (rng.randint, ((2,), 11)), (rng.permutation, (6,))],
    ids=["uniform", "normal", "normal-float64", "bernoulli", "randint", "permutation"])
def test_a_tensor_of_seeds_draws_each_seeds_numbers(sampler, args):
    """Row s of a draw with a tensor of seeds is bit for bit seed s's own draw (indices past 2^32 included)."""
    seeds = torch.tensor([0, 1, 9, 70001, 2**31 - 1, -3])
    index = torch.cat([torch.arange(37), (torch.arange(5) + 3) << 32])
    both = sampler(seeds, 2004, index, *args)
    assert both.shape[:2] == (len(seeds), len(index))
    for row, seed in enumerate(seeds.tolist()):
        assert torch.equal(both[row], sampler(seed, 2004, index, *args)), seed
    assert not torch.equal(both[0], both[1])
