"""Headline predictions of Pan et al. 2023 (Thm 1; Thm 2 vs Lemma 1) on a small fixed-seed config, through the
experiment's own runs.

Size: k = 6, d = 64, P = 16 and, by the experiment's size rule, m = 5, N = 600, N2 = 300; mu = 0.02 in
training, single-view share 0.5 in the 10000 test samples; seeds 0, 1, 2. Measured when written (one thread):

| seed | pretraining captured | MRP+FT single-view | SL single-view, q=3 (shared) | SL single-view, q=5 sigma0=0.01 |
|---|---|---|---|---|
| 0 | 0.83 (lottery lost at m=5) | 0.805 | 0.918 | 0.690 (classes with both: 0.50) |
| 1 | 1.00 (step 375) | 1.000 | 0.996 | 0.703 (0.50) |
| 2 | 1.00 (step 601) | 1.000 | 1.000 | 0.681 (0.50) |

* Theorem 1 (a) + Theorem 2: where pretraining captures every feature, MRP + fine-tuning classifies
  single-view data (>= 0.95). Holds in the seeds that capture everything (2 of 3 here).
* Lemma 1's mechanism: with a sharp race (q = 5, small sigma0) SL learns one feature in some classes and
  misses single-view samples. Holds.
* The headline comparison on equal terms (same q = 3, sigma0, m): MRP + FT single-view above SL by 0.05.
  FAILS at this size: SL learns both features of (almost) every class, so there is no gap. Kept as a
  strict xfail: it turns into a failure the day the comparison starts to hold, so the README gets updated.
~1.5-2.5 minutes on one thread (the equal-terms comparison's SL runs are marked slow).
"""
import argparse

import pytest
import torch

from featlearn.experiments import mrp as experiment
from featlearn.experiments.study import Study

SEEDS = (0, 1, 2)
SIZE = experiment.size_rule(6, d=64, P=16)
MU = 0.02
SHARED = experiment.SETTINGS.shared
SHARED_ARGS = dict(q=SHARED.q, sigma0=SHARED.sigma0, lr_scale=SHARED.lr_scale)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per seed: MRP pretraining + fine-tuning at the shared settings, and SL with a sharp race."""
    yield from _fits(tmp_path_factory, "mrp headline", 3, lambda study, seed: {
        **experiment.mrp(study, SIZE, MU, seed, **SHARED_ARGS),
        "sl_sharp": experiment.supervised(study, SIZE, MU, seed, q=5, sigma0=0.01, lr_scale=5.0)})


@pytest.fixture(scope="module")
def shared_sl(tmp_path_factory):
    """Per seed: SL at the shared settings (only the strict xfail below reads it: slow, to keep the suite short)."""
    yield from _fits(tmp_path_factory, "mrp headline sl", 1,
                     lambda study, seed: experiment.supervised(study, SIZE, MU, seed, **SHARED_ARGS))


def _fits(tmp_path_factory, name: str, per_seed: int, fit):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    args = argparse.Namespace(out=tmp_path_factory.mktemp(name.replace(" ", "_")), overwrite=False, seed=list(SEEDS))
    try:
        with Study(args, name, fits=per_seed * len(SEEDS)) as study:
            yield {seed: fit(study, seed) for seed in SEEDS}
    finally:
        torch.set_num_threads(old)


def test_size_rule_gives_the_documented_size():
    assert (SIZE.m, SIZE.N, SIZE.N2) == (5, 600, 300)


def test_finetuning_after_full_capture_classifies_single_view(runs):
    complete = [s for s in SEEDS if runs[s]["pretrain"]["features captured"] == 1.0]
    assert len(complete) >= 2, {s: runs[s]["pretrain"]["features captured"] for s in SEEDS}
    for seed in complete:
        finetune = runs[seed]["finetune"]
        assert finetune["test acc single-view"] >= 0.95, (seed, finetune)   # measured 1.000
        assert finetune["test acc multi-view"] >= 0.95, (seed, finetune)


def test_supervised_with_a_sharp_race_misses_single_view(runs):
    for seed in SEEDS:
        sl = runs[seed]["sl_sharp"]
        assert sl["test acc multi-view"] >= 0.95, (seed, sl)                # multi-view is easy for SL
        assert sl["classes with both features"] <= 0.9, (seed, sl)          # measured 0.50
        assert sl["test acc single-view"] <= 0.9, (seed, sl)                # measured 0.68-0.70


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="Lemma 1's gap does not appear on equal terms at this size: at q = 3 SL learns both "
                          "features of almost every class (single-view gaps -0.124, +0.004, +0.000)")
def test_finetuning_beats_supervised_on_single_view_on_equal_terms(runs, shared_sl):
    gaps = [runs[s]["finetune"]["test acc single-view"] - shared_sl[s]["test acc single-view"] for s in SEEDS]
    assert sum(gaps) / len(gaps) >= 0.05, gaps
