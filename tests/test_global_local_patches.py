"""The patch sampler of Huang et al. 2025 (Def. 2.1-2.7): sizes from the exponents (every preset),
orthonormal geometry in both bases, areas that partition the positions, exact-count masks, samples that are
functions of (seed, index), contrastive views sharing their noise of variance 1/d, and refusals naming the
field."""
import doctest
import math
from pathlib import Path

import pytest
import torch
import yaml

from featlearn.datamodules import global_local_patches
from featlearn.datamodules.global_local_patches import GlobalLocalPatchDataModule
from featlearn.errors import ConfigError
from featlearn.theory import vit as theory

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "vit"

# preset -> (P, C_1, C_s, N - 1, Delta)
PRESETS = {
    "p256_pos": (256, 128, 16, 8, 0.25), "p256_neg": (256, 32, 16, 14, -0.25),
    "p256_pos_small": (256, 64, 4, 48, 0.25), "p1024_pos": (1024, 512, 32, 16, 0.30),
    "p1024_pos_strong": (1024, 512, 4, 128, 0.60), "p1024_pos_weak": (1024, 256, 32, 24, 0.10),
    "p1024_neg": (1024, 64, 32, 30, -0.30), "p1024_neg_weak": (1024, 128, 32, 28, -0.10),
    "p4096_pos": (4096, 2048, 64, 32, 1 / 3), "p4096_neg": (4096, 128, 64, 62, -1 / 3),
}


def _dm(**kw):
    base = dict(P=47, K=3, kappa_c=None, kappa_s=None, C_1=12, C_s=5, d=77, batch_size=8, seed=4)
    base.update(kw)
    return GlobalLocalPatchDataModule(**base)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_the_spec_sizes(name):
    P, C_1, C_s, n_local, delta = PRESETS[name]
    args = yaml.safe_load((CONFIGS / f"data_{name}.yaml").read_text())["init_args"]
    dm = GlobalLocalPatchDataModule(**args)
    assert (dm.P, dm.C_1, dm.C_s, dm.n_local) == (P, C_1, C_s, n_local)
    assert dm.delta == pytest.approx(delta, abs=1e-12) and dm.delta_eff == pytest.approx(delta, abs=1e-9)
    assert dm.d == theory.embedding_dim(P, dm.K * dm.n_areas) and dm.d % 64 == 0


def test_size_rule_gives_leftover_to_the_global_area():
    s = theory.area_sizes(256, kappa_c=0.8, kappa_s=0.5)  # C_1 = round(84.4) = 84, 10 local areas, 12 left over
    assert (s["C_1"], s["C_s"], s["n_local"]) == (96, 16, 10)
    assert s["kappa_c_eff"] == pytest.approx(math.log(96) / math.log(256))
    assert s["delta"] == pytest.approx(0.1) and s["delta_eff"] == pytest.approx(0.5 - 2 * (1 - s["kappa_c_eff"]))
    s = theory.area_sizes(256, C_1=100, C_s=16)
    assert (s["C_1"], s["n_local"], s["delta"]) == (112, 9, None)


@pytest.mark.parametrize("basis", ["canonical", "haar"])
def test_geometry_is_orthonormal_and_areas_partition_the_positions(basis):
    dm = _dm(basis=basis, dtype="float64")
    E, V = dm.E, dm.V
    B = torch.cat([E, V])
    assert E.shape == (47, 77) and V.shape == (3 * dm.n_areas, 77)
    torch.testing.assert_close(B @ B.T, torch.eye(B.shape[0], dtype=torch.float64), atol=1e-12, rtol=0)
    if basis == "canonical":
        assert torch.equal(E, torch.eye(77, dtype=torch.float64)[:47])
    else:  # delocalised: no coordinate vector
        assert float(E.abs().max()) < 0.9
    part = dm.partition
    assert part.shape == (3, 47) and int(part.min()) == 0 and int(part.max()) == dm.n_areas - 1
    for k in range(3):
        counts = torch.bincount(part[k], minlength=dm.n_areas)
        assert counts.tolist() == [dm.C_1] + [dm.C_s] * dm.n_local
        assert torch.equal(counts, dm.area_sizes[k])
    assert not torch.equal(part[0], part[1]) and not torch.equal(part[1], part[2])  # different partitions


def test_grid_layout_tiles_the_torus():
    dm = GlobalLocalPatchDataModule(P=256, K=3, kappa_c=0.875, kappa_s=0.5, layout="grid")
    assert dm.tile == (4, 4)
    side = 16
    coords = dm.grid_coordinates()
    for k in range(3):
        part = dm.partition[k]
        assert torch.bincount(part).tolist() == [128] + [16] * 8
        for area in range(1, 9):  # each local area is a 4 x 4 block of the grid, up to a cyclic shift
            rows, cols = coords[part == area].T
            r, c = sorted(set(rows.tolist())), sorted(set(cols.tolist()))
            assert len(r) == 4 and len(c) == 4  # 16 cells on 4 rows and 4 columns: the product set
            assert any(set(r) == {(r0 + i) % side for i in range(4)} for r0 in r)
            assert any(set(c) == {(c0 + i) % side for i in range(4)} for c0 in c)
    assert not torch.equal(dm.partition[0], dm.partition[1])


@pytest.mark.parametrize("seed", range(20))
def test_grid_clusters_share_no_local_area_and_the_global_area_is_a_block(seed):
    """Huang et al. 2025, Def. 2.1: each cluster its own partition (no local area of one cluster is an area of another;
    with offsets drawn from only h w values, 5 of these 20 seeds used to repeat a tiling at K = 4); our grid layout: the
    global area is a block of tiles (here 2 x 4 tiles of 4 x 4, up to a cyclic shift)."""
    dm = GlobalLocalPatchDataModule(P=256, K=4, kappa_c=0.875, kappa_s=0.5, layout="grid", seed=seed)
    part = dm.partition
    areas = [{frozenset(torch.nonzero(part[k] == a).flatten().tolist()) for a in range(1, 9)} for k in range(4)]
    for k in range(4):
        for j in range(k + 1, 4):
            assert not areas[k] & areas[j], (seed, k, j)
    coords = dm.grid_coordinates()
    for k in range(4):
        rows, cols = coords[part[k] == 0].T
        r, c = sorted(set(rows.tolist())), sorted(set(cols.tolist()))
        assert len(rows) == 128 and len(r) * len(c) == 128        # a product set: rows x columns
        for vals, size in ((r, len(r)), (c, len(c))):             # each a cyclic interval of the grid
            assert size == 16 or any(set(vals) == {(v0 + i) % 16 for i in range(size)} for v0 in vals)


def test_grid_refuses_more_clusters_than_tilings():
    with pytest.raises(ConfigError, match="data.K:"):
        GlobalLocalPatchDataModule(P=64, K=5, C_1=32, C_s=4, kappa_c=None, kappa_s=None, layout="grid")


def test_samples_carry_their_area_vectors():
    dm = _dm(dtype="float64")
    b = dm.batch(torch.arange(16), "train")
    x = dm.dense(b)
    assert x.shape == (16, 47, 77)
    assert float((x @ dm.E.T).abs().max()) == 0.0                       # features are orthogonal to positions
    coeff = x @ dm.V.T                                                  # [B, P, K N]
    want = torch.zeros_like(coeff).scatter_(-1, b["feat_id"].unsqueeze(-1), b["z"].unsqueeze(-1))
    torch.testing.assert_close(coeff, want, atol=1e-12, rtol=0)
    assert torch.equal(b["area"], dm.partition[b["cluster"]]) and torch.equal(b["is_global"], b["area"] == 0)
    assert torch.equal(b["feat_id"], b["cluster"].unsqueeze(-1) * dm.n_areas + b["area"])
    assert torch.equal(b["z"], b["z_area"].gather(1, b["area"]))
    big = dm.batch(torch.arange(4000), "train")
    assert 0.9 <= float(big["z_area"].min()) and float(big["z_area"].max()) < 1.1
    assert float(big["z_area"].mean()) == pytest.approx(1.0, abs=2e-3)
    freq = torch.bincount(big["cluster"], minlength=3).double() / 4000
    assert float((freq - 1 / 3).abs().max()) < 0.03
    const = _dm(z_law="const").batch(torch.arange(4), "train")
    assert torch.equal(const["z_area"], torch.ones_like(const["z_area"]))


def test_mae_masks_have_the_exact_count_and_are_uniform():
    dm = _dm()
    dm.use_mae_masks(0.75)
    n = theory.masked_count(47, 0.75)
    assert n == 35 and dm.n_masked == n
    b = dm.batch(torch.arange(3000), "train")
    assert (b["mask"].sum(1) == n).all() and b["masked_idx"].shape == (3000, n)
    assert (b["masked_idx"].diff(dim=1) > 0).all()                                 # sorted, no repeats
    assert torch.equal(torch.zeros_like(b["mask"]).scatter_(1, b["masked_idx"], True), b["mask"])
    freq = b["mask"].double().mean(0)
    assert float((freq - n / 47).abs().max()) < 0.03                             # every position equally likely
    # the exact-count law: a local area is fully masked with the hypergeometric probability
    full = (b["mask"].unsqueeze(1) & (b["area"].unsqueeze(1) == torch.arange(1, dm.n_areas).view(1, -1, 1)))
    rate = float((full.sum(-1) == dm.C_s).double().mean())
    assert rate == pytest.approx(theory.prob_fully_masked(47, 5, n, given_masked=False), abs=0.02)


def test_samples_are_functions_of_seed_and_index():
    for method in ("mae", "cl"):
        dm = _dm()
        dm.use_mae_masks(0.5) if method == "mae" else dm.use_cl_views(0.5)
        whole = dm.batch(torch.arange(10, 22), "train")
        part = dm.batch(torch.arange(16, 19), "train")
        for key, value in part.items():
            assert torch.equal(value, whole[key][6:9]), key
        other = _dm(seed=5)
        other.use_mae_masks(0.5) if method == "mae" else other.use_cl_views(0.5)
        assert not torch.equal(other.batch(torch.arange(16, 19), "train")["z_area"], part["z_area"])
    # splits draw different samples
    dm = _dm()
    assert not torch.equal(dm.batch(torch.arange(8), "val")["z_area"], dm.batch(torch.arange(8), "train")["z_area"])


def test_fixed_mode_redraws_masks_every_step_not_samples():
    from types import SimpleNamespace

    dm = _dm(mode="fixed", num_train=16, batch_size=None)
    dm.use_mae_masks(0.5)
    seen = []
    for step in (0, 1):
        dm.trainer = SimpleNamespace(global_step=step, global_rank=0, world_size=1, accumulate_grad_batches=1)
        seen.append(dm.batch(torch.arange(16), "train"))
    assert torch.equal(seen[0]["z_area"], seen[1]["z_area"]) and not torch.equal(seen[0]["mask"], seen[1]["mask"])


def test_contrastive_views_share_the_noise_of_variance_one_over_d():
    dm = _dm(d=200)
    dm.use_cl_views(0.4)
    assert dm.noise_var == pytest.approx(1 / 200)
    b = dm.batch(torch.arange(400), "train")
    n = theory.masked_count(47, 0.4)
    assert (b["mask1"].sum(1) == n).all() and (b["mask2"].sum(1) == n).all()
    assert not torch.equal(b["mask1"], b["mask2"])                                # independent maskings
    x, v1, v2 = dm.dense(b), dm.dense(b, "view1"), dm.dense(b, "view2")
    both = ~b["mask1"] & ~b["mask2"]
    assert torch.equal(v1[both], v2[both]) and torch.equal(v1[both], x[both])      # the same noisy patches
    assert float(v1[b["mask1"]].abs().max()) == 0.0                                # masking zeroes the noise too
    noise = b["noise"].double()
    assert float(noise.var()) == pytest.approx(1 / 200, rel=0.01)
    assert float(noise.mean()) == pytest.approx(0.0, abs=3e-4)
    chosen = _dm(noise_var=0.01)
    chosen.use_cl_views(0.4)
    assert chosen.noise_var == 0.01
    mae = _dm()
    mae.use_mae_masks(0.5)
    assert mae.noise_var == 0.0 and "noise" not in mae.batch(torch.arange(2), "train")


@pytest.mark.parametrize("kwargs,field", [
    (dict(P=3), "data.P"),
    (dict(K=0), "data.K"),
    (dict(kappa_c=1.0, kappa_s=0.5, C_1=None, C_s=None, P=256, d=None), "data.kappa_c"),  # no local area
    (dict(kappa_c=0.5, kappa_s=0.5, C_1=None, C_s=None, P=256, d=None), "data.kappa_c"),  # global = local size
    (dict(C_1=45), "data.C_1"),
    (dict(C_s=40), "data.C_1"),
    (dict(kappa_c=1.5, C_1=None), "data.kappa_c"),
    (dict(d=70), "data.d"),
    (dict(z_low=0.0), "data.z_low"),
    (dict(z_low=1.1, z_high=0.9), "data.z_high"),
    (dict(layout="grid"), "data.layout"),                                          # P = 47 is not a square
    (dict(layout="grid", P=64, C_1=22, C_s=7, d=None), "data.layout"),             # 7 is no tile of an 8 x 8 grid
    (dict(dtype="float16"), "data.dtype"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        _dm(**kwargs)
    assert err.value.field == field, str(err.value)


def test_masking_ratios_that_mask_nothing_or_everything_are_refused():
    dm = _dm()
    with pytest.raises(ConfigError, match="model.gamma:"):
        dm.use_mae_masks(0.005)
    with pytest.raises(ConfigError, match="model.gamma0:"):
        dm.use_cl_views(0.995)


def test_docstring_examples():
    for module in (global_local_patches, theory):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__
