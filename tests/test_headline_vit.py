"""Headline of Huang et al. 2025 (Thm 4.1/4.2 vs Thm 4.4) through the experiment's own command,
``python -m featlearn.experiments.vit``, on the shipped P = 256 configs (``mae.yaml`` / ``mae_neg.yaml``: K = 4,
gamma = 0.75, eta 6.76, B = 32; ``cl.yaml`` / ``cl_neg.yaml``: K = 8, d = 512, gamma0 = 0.5, eta = 5000, B = 32)
at seed 0 with shorter budgets: MAE 120 steps, CL 40 steps.

Measured when written (seed 0; end values on the last training batch, init on the held-out batch):

| run | own-area attn, local queries (init) | own-area attn, global | local -> global area (init) | min phi_loc->glob |
|---|---|---|---|---|
| MAE, Delta +0.25 | 0.912 (0.015) | 0.928 | 0.005 (0.123) | -0.96 |
| MAE, Delta -0.25 | 0.906 (0.015) | 0.919 | 0.002 (0.030) | -0.24 |
| CL, Delta +0.25 | 0.016 (0.031) | 0.594 | 0.594 (0.249) | 0 (rises to 1.45) |
| CL, Delta -0.25 | 0.031 (0.031) | 0.079 | 0.079 (0.060) | 0 (rises to 0.23) |

* MAE attends to each patch's own area, local and global, for either sign of Delta: holds.
* CL collapses onto the global area while its own local area stays at or below init: holds (Delta < 0: slowly,
  the held-out curve rises 0.060 -> 0.074 in 40 steps and to 0.80 by step 200).
* The dip of phi_loc->glob is deeper for Delta > 0 (our threshold: at least 2x): holds, 4x.
* Two phases for Delta > 0 (own-area learning delayed behind the global decoupling): FAILS at P = 256. The
  own correlation grows at the same rate for both signs (0.20 vs 0.20 at step 10) and local own-area attention
  reaches 0.5 at step 70 for both; a strict xfail.

~30 s on one thread of a busy 2-core machine. The slow test runs the default budgets (MAE 300, CL 200 steps).
"""
import json
import math
import shlex
import warnings
from pathlib import Path

import pytest
import torch

from featlearn.cli import make_cli
from featlearn.experiments import vit as experiment

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
STEPS_MAE, STEPS_CL, EVERY = 120, 40, 10
REQUIRED = ("method", "delta", "own_area_local", "own_area_global", "attn_global", "final_loss", "loss_floor",
            "phi_local_to_global_min", "phi_local_to_global_argmin_step")


def _run(out: Path, *argv: str) -> dict:
    old = torch.get_num_threads()
    try:
        rows = experiment.main(["--seed", "0", "--out", str(out), *argv])
    finally:
        torch.set_num_threads(old)
    return {(r["method"], r["point"]): r for r in rows}


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    out = tmp_path_factory.mktemp("vit_headline") / "run"
    return out, _run(out, "--steps-mae", str(STEPS_MAE), "--steps-cl", str(STEPS_CL), "--every", str(EVERY))


def test_mae_attends_to_its_own_area_for_either_sign_of_delta(short):
    rows = short[1]
    for point in ("p256_pos", "p256_neg"):
        mae, cl = rows["mae", point], rows["cl", point]
        # margins: measured 0.91 / 0.91 local and 0.93 / 0.92 global after 120 steps, from 0.015 at init
        assert mae["own_area_local"] >= 0.8 and mae["own_area_local"] >= 20 * mae["init_own_area_local"], mae
        assert mae["own_area_global"] >= 0.85, mae
        assert mae["attn_global"] <= 0.05 < mae["init_attn_global"] + 0.05, mae   # local queries leave the global area
        # the headline contrast on the same data: MAE's local queries find their area, CL's do not
        assert mae["own_area_local"] >= cl["own_area_local"] + 0.5, (mae["own_area_local"], cl["own_area_local"])


def test_cl_collapses_onto_the_global_area(short):
    rows = short[1]
    pos, neg = rows["cl", "p256_pos"], rows["cl", "p256_neg"]
    assert pos["attn_global"] >= pos["init_attn_global"] + 0.2, pos                    # measured 0.249 -> 0.594
    curve = neg["per_seed"][0]["curves"]["attn_glob_from_local"]                         # held-out batch, every 10 steps
    assert all(b >= a - 0.001 for a, b in zip(curve, curve[1:])) and curve[-1] >= curve[0] + 0.008, curve
    for row in (pos, neg):
        run = row["per_seed"][0]
        assert row["own_area_local"] <= row["init_own_area_local"] + 0.005, row
        assert run["phi_global_own"] >= 5 * run["phi_local_features_absmean"] > 0, run
        assert row["phi_local_to_global"] > 0 and row["phi_local_own"] < 0.05, row


def test_mae_dip_is_deeper_for_positive_delta(short):
    rows = short[1]
    pos, neg = rows["mae", "p256_pos"], rows["mae", "p256_neg"]
    assert pos["phi_local_to_global_min"] <= 2 * neg["phi_local_to_global_min"] < 0, (pos, neg)   # -0.96 vs -0.24
    assert pos["phi_local_to_global_argmin_step"] > 0
    assert pos["theory_dip"] == pytest.approx(-(0.25 / 1.8) * math.log(256)) and neg["theory_dip"] is None


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="Thm 4.2b's two phases are not visible at P = 256: the own-area correlation of local "
                          "patches grows as fast for Delta = +0.25 as for -0.25 (0.20 vs 0.20 at step 10), and "
                          "local own-area attention reaches 0.5 at step 70 for both")
def test_own_area_learning_is_delayed_for_positive_delta(short):
    rows = short[1]
    pos, neg = rows["mae", "p256_pos"], rows["mae", "p256_neg"]
    assert pos["step_own_local_half"] >= 1.5 * neg["step_own_local_half"], (pos["step_own_local_half"],
                                                                            neg["step_own_local_half"])


def test_table_json_and_figures_are_written(short):
    out, rows = short
    table = (out / "vit_table.md").read_text()
    for method, sign in (("MAE", "+0.25"), ("CL", "+0.25"), ("MAE", "-0.25"), ("CL", "-0.25")):
        assert f"| {method} | p256_{'pos' if sign[0] == '+' else 'neg'}: " in table and f"| {sign} (" in table
    assert "Predicted vs measured" in table and "FAILS" in table            # the two-phase line fails
    saved = json.loads((out / "vit_table.json").read_text())
    assert isinstance(saved, list) and len(saved) == 4
    for row in saved:
        for key in REQUIRED[1:]:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (row["method"], key, row[key])
        assert row["method"] in ("mae", "cl") and row["delta"] in (0.25, -0.25)
        curves = row["per_seed"][0]["curves"]
        steps = STEPS_MAE if row["method"] == "mae" else STEPS_CL
        assert curves["step"] == list(range(0, steps + 1, EVERY))
        assert all(len(curves[k]) == len(curves["step"]) for k in experiment.CURVES)
        N = row["n_local"] + 1
        if row["method"] == "mae":   # the floor of the run's last batch bounds that batch's loss (issue 22)
            run = row["per_seed"][0]
            assert run["final_loss"] >= run["loss_floor"] - 1e-6 and run["loss_floor_expected"] > 0, run
            assert f"MAE loss above its batch's floor ({row['point']})" in table
        assert len(row["per_seed"][0]["area_matrix"]) == N and len(row["per_seed"][0]["area_matrix"][0]) == N + 1
    for name in ("areas", "queries", "curves"):
        png = (out / f"vit_table_{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, name


def test_a_run_is_its_lightning_fit_command(short, tmp_path):
    """The row's ``config`` is the ``lightning fit`` command of the run: training it again through the CLI
    gives the same final metrics, bit for bit (the curves' callback only reads)."""
    run = short[1]["mae", "p256_pos"]["per_seed"][0]
    args = shlex.split(run["config"])
    assert args[:4] == ["lightning", "fit", "--config", "configs/vit/mae.yaml"]
    with warnings.catch_warnings():  # LightningCLI warns when args= and pytest's sys.argv are both present
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        cli = make_cli(["--config", str(ROOT / args[3]), *args[4:], "--trainer.logger.init_args.save_dir",
                        str(tmp_path), "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"],
                       run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    final = cli.model.final_metrics()
    for key in ("own_area_local", "own_area_global", "final_loss", "phi_local_to_global_min"):
        assert final[key] == run[key], key


@pytest.mark.slow  # an experiment's smoke run and resume (~16 s); the Study's resume is tested in tests/test_study.py
def test_presets_and_delta_points_build_the_documented_data(tmp_path):
    argv = ("--preset", "p256_pos_small", "--delta", "0.4", "--steps-mae", "2", "--steps-cl", "2", "--every", "1")
    rows = _run(tmp_path / "smoke", *argv)
    # the same command resumes from study.json: no fit runs again (each run's wall_s is the cached one), the same
    # rows, in the same folder, the figures drawn from the cached results
    again = _run(tmp_path / "smoke", *argv)
    assert [r["per_seed"] for r in again.values()] == [r["per_seed"] for r in rows.values()]
    assert not (tmp_path / "smoke-2").exists() and (tmp_path / "smoke" / "vit_table_queries.png").is_file()
    small_mae, small_cl = rows["mae", "p256_pos_small"], rows["cl", "p256_pos_small"]
    assert (small_mae["C_1"], small_mae["C_s"], small_mae["n_local"], small_mae["mask_ratio"]) == (64, 4, 48, 0.5)
    assert (small_cl["K"], small_cl["d"], small_cl["mask_ratio"]) == (8, 704, 0.5)   # d >= P + K N = 648
    point = rows["mae", "delta+0.396"]
    assert (point["C_1"], point["n_local"]) == (192, 4)
    assert point["delta"] == pytest.approx(point["delta_eff"]) == pytest.approx(2 * math.log(192) / math.log(256) - 1.5)
    assert rows["cl", "delta+0.396"]["C_1"] == 192 and rows["cl", "delta+0.396"]["K"] == 8


@pytest.mark.parametrize("argv, option", [
    (["--seed", "1", "1"], "--seed"), (["--delta", "0.6"], "--delta"), (["--delta", "0.25"], "--delta"),
    (["--delta", "0.3", "0.31"], "--delta"), (["--preset", "p1024_pos"], "--preset"), (["--preset"], "--preset"),
    (["--methods", "sgd"], "--methods"), (["--methods", "mae", "mae"], "--methods"), (["--steps-mae", "0"], "--steps-mae"),
    (["--steps-cl", "-3"], "--steps-cl"), (["--every", "0"], "--every"), (["--eval-batch", "1"], "--eval-batch"),
])
def test_bad_options_are_refused_before_any_run(argv, option, capsys, tmp_path):
    with pytest.raises(SystemExit):
        experiment.parse_args([*argv, "--out", str(tmp_path / "never")])
    assert option in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
def test_default_budgets_show_the_headline(tmp_path):
    """The default command at seed 0 (MAE 300 steps, CL 200; ~90 s). Measured: MAE own-area attention 0.962 /
    0.957 (Delta +0.25) and 0.960 / 0.960 (-0.25); min phi_loc->glob -1.02 vs -0.26 (at step 300: no recovery);
    CL local queries' attention to the global area 0.249 -> 0.601 and 0.060 -> 0.807, own local 0.031 -> 0.016 / 0.007."""
    rows = _run(tmp_path / "full")
    for point in ("p256_pos", "p256_neg"):
        mae, cl = rows["mae", point], rows["cl", point]
        run = mae["per_seed"][0]
        assert mae["own_area_local"] >= 0.85 and mae["own_area_global"] >= 0.9, mae
        assert run["loss_local"] <= 3 * run["loss_floor_local_expected"] + 0.01, run
        assert run["final_loss"] >= run["loss_floor"] - 1e-6, run
        assert cl["own_area_local"] <= cl["init_own_area_local"] + 0.005, cl
        assert cl["attn_global"] >= cl["init_attn_global"] + 0.2, cl
    assert rows["mae", "p256_pos"]["phi_local_to_global_min"] <= 2 * rows["mae", "p256_neg"]["phi_local_to_global_min"]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="Thm 4.4's collapse to 1 - 1/poly(P) is not reached: at Delta = +0.25 the local queries' "
                          "attention to the global area stalls at 0.60 from step ~50 to 800 (0.249 at init)")
def test_cl_collapse_completes_at_positive_delta(tmp_path):
    rows = _run(tmp_path / "cl", "--methods", "cl", "--preset", "p256_pos")
    assert rows["cl", "p256_pos"]["attn_global"] >= 0.9, rows["cl", "p256_pos"]["attn_global"]
