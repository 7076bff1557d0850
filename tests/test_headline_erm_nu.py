"""Headline of Shi 2024, Ch. 6 (ERM-NU; Shi, Ming, Fan, Sala, Liang, CPAL 2024) through the experiment's own runs
(:mod:`featlearn.experiments.erm_nu`: the same configs, budgets and selection) at small sizes, the seeds of a run
trained together:

* the 2-D toy, early-stopped (300 steps): ERM-NU's OOD accuracy at least ERM's under the same budget of fits, on
  every seed (trained to convergence the ordering turns: docs/methods/erm_nu.md); the chapter's gap (0.94 against
  0.76) is not reproduced (a strict xfail with the measured gap);
* Prop. 6.3 on a small D_gamma: ERM-rank right on every OOD sample, ERM-l2 below exp(-r/10);
* Fig. 6.5's mechanism on D_gamma: ERM-NU at a moderate lambda keeps the invariant coordinates (OOD accuracy near
  1 where ERM's is 0) and lowers the stable rank of the features.
"""
import pytest
import torch

from featlearn.experiments.common import experiment_parser, parse_experiment_args, quiet_lightning
from featlearn.experiments.erm_nu import (Point, Sweep, Theory, Toy, evaluate, prop_run, select, sweep_run,
                                         toy_runs)
from featlearn.experiments.study import Study
from featlearn.theory.erm_nu import l2_ood_bound

pytestmark = pytest.mark.usefixtures("one_thread")
SEEDS = [0, 1, 2, 3]  # the toy's
THEORY_SEEDS = [0, 1]  # D_gamma's results hardly move with the seed


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    quiet_lightning()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("erm_nu") / "study"
    args = parse_experiment_args(experiment_parser("headline", str(out)), ["--out", str(out)])
    with Study(args, "fits", fits=0) as running:
        yield running
    torch.set_num_threads(threads)


def _mean(fits: dict, key: str) -> float:
    return sum(f[key] for f in fits.values()) / len(fits)


@pytest.fixture(scope="module")
def toy(study):
    settings = Toy(steps=300, lams=[0.003, 0.01], x1_noise=[0.0])
    chosen = {}
    for column in ("erm", "nuclear"):
        budget = [study.fit_seeds(run, SEEDS, evaluate) for run in toy_runs(settings, 0.0, column)]
        chosen[column] = {s: select([fits[s] for fits in budget]) for s in SEEDS}
    return chosen


def test_toy_nu_is_at_least_erm_out_of_distribution(toy):
    """Two fits per column and seed (ERM: two restarts; NU: lambda 0.003 and 0.01 from the same two starts), the
    best on ID validation. Measured OOD, seeds 0-3: ERM 0.9614, 0.9561, 0.9648, 0.9579; ERM-NU 0.9660, 0.9583,
    0.9668, 0.9625 (seeds 4-7: NU ahead on three of four, behind by 0.0001 on seed 7)."""
    erm, nu = toy["erm"], toy["nuclear"]
    assert all(nu[s]["ood_accuracy"] >= erm[s]["ood_accuracy"] for s in SEEDS), (nu, erm)
    assert _mean(nu, "ood_accuracy") > _mean(erm, "ood_accuracy")  # not a tie: a penalty that did nothing would tie
    assert _mean(nu, "test_accuracy") >= _mean(erm, "test_accuracy")  # the 7/3 rule: OOD error follows ID error


@pytest.mark.xfail(strict=True, reason="the chapter's toy gap (ERM 0.76, ERM-NU 0.94 OOD) is not reproduced: measured "
                                       "+0.003 (seeds 0-3); under the symmetric completion OOD 0.76 needs ID ~0.90, "
                                       "not the 'nearly perfect' ID the chapter reports")
def test_toy_nu_gains_the_chapters_margin(toy):
    assert _mean(toy["nuclear"], "ood_accuracy") - _mean(toy["erm"], "ood_accuracy") > 0.1


def test_prop_6_3_rank_beats_l2_out_of_distribution(study):
    """r = 16, d = 128, gamma = 0.45 (outside the proposition's gamma window, 3 / sqrt(16) = 0.75, but the l2 optimum
    still leans on U: gamma^2 (d - r) = 23 > r / 4), 120 steps of 256 fresh samples: measured ERM-rank OOD 1.0,
    ERM-l2 0.0 on both seeds."""
    settings = Theory(steps=120, batch_size=256, lam_l2=0.1, b_rank=4, support_step=30, points=[])
    point = Point(r=16, d=128, gamma=0.45)
    l2 = study.fit_seeds(prop_run(settings, point, "l2"), THEORY_SEEDS, evaluate)
    rank = study.fit_seeds(prop_run(settings, point, "rank"), THEORY_SEEDS, evaluate)
    # ERM-rank's informative result is its support (Lemma 6.2). Once it lies in R, OOD accuracy 1.0 follows by
    # construction: from w = 0 the risk's gradient -sigmoid(-m) z_j <= 0 keeps every w_j on R >= 0, and the margin,
    # a nonnegative combination of R's U[0,1] coordinates (the same in and out of distribution), is positive
    assert all(f["support_invariant"] == 1.0 for f in rank.values()), rank
    assert all(f["ood_accuracy"] == 1.0 for f in rank.values()), rank  # the consequence, not a separate finding
    assert all(f["ood_accuracy"] < l2_ood_bound(16) for f in l2.values()), l2  # the informative half of Prop. 6.3
    assert all(f["test_accuracy"] > 0.999 for f in (*l2.values(), *rank.values()))


def test_nu_keeps_the_invariant_coordinates_and_lowers_the_rank(study):
    """r = 32, d = 160, gamma = 0.45, batches of 384 > d, 300 steps at lr 1: measured (seeds 0, 1) ERM OOD 0.0,
    ERM-NU at lambda = 0.001 1.0; OOD stable rank 1.55 against 1.33; share of |w| on R 0.22 against 0.69."""
    settings = Sweep(point=Point(r=32, d=160, gamma=0.45), batch_size=384, steps=300, lams=[], variants=[])
    erm = study.fit_seeds(sweep_run(settings, 0.0), THEORY_SEEDS, evaluate)
    nu = study.fit_seeds(sweep_run(settings, 0.001), THEORY_SEEDS, evaluate)
    assert _mean(erm, "ood_accuracy") < 0.05 and _mean(nu, "ood_accuracy") > 0.9, (erm, nu)
    assert _mean(nu, "ood_stable_rank") < _mean(erm, "ood_stable_rank") - 0.1
    assert _mean(nu, "invariant_share") > 0.6 > _mean(erm, "invariant_share")
