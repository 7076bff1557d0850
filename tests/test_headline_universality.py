"""Headline of Shi 2024, Ch. 7 (Shi et al. 2023) through the experiment's own entry point, at T = 8 (s = 5, r = 10,
u = 10), seed 0,
600 pretraining steps (200 for CR): the target-specific representation is more label-efficient on its own task
at small m; the universal one is better on another task (the specific one plateaus there); contrastive
regularisation recovers the target-task efficiency while keeping the other-task error of the universal
representation. And the experiment's options refuse bad input by name."""
import pytest
import torch

from featlearn.experiments.universality import main, parse_args

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("universality") / "u"
    res = main(["--T", "8", "--steps", "600", "--m", "8", "96", "--repeats", "20", "--out", str(out)])
    torch.set_num_threads(threads)
    return res, out


def _errors(res, task, probe="errors"):
    err = res["sweeps"][0][probe]
    return {rep: err[rep][task] for rep in err}


def test_universality_vs_label_efficiency(sweep):
    """Measured (seed 0, 20 nested label sets): target MSE at m = 8: universal 0.81, specific 0.46, CR 0.50;
    other task at m = 8: universal 0.82, specific 1.14, CR 0.82; at m = 96 every target error is 0.07.
    The closed-form specific representation plateaus on the other task (0.60 at m = 96; v2 + noise = 0.56).
    Margins are about a third of the measured gaps."""
    res, out = sweep
    tgt, oth = _errors(res, "target"), _errors(res, "other")
    assert tgt["universal"][8] - tgt["specific"][8] > 0.12, tgt                 # specific wins on the target, small m
    assert oth["specific"][8] - oth["universal"][8] > 0.12, oth                 # universal wins on another task
    assert abs(tgt["universal"][96] - tgt["specific"][96]) < 0.03, tgt          # the gap closes on the target
    assert tgt["universal"][8] - tgt["cr"][8] > 0.12, tgt                       # CR recovers target efficiency
    assert abs(tgt["cr"][8] - tgt["specific"][8]) < 0.1, tgt                    # ... close to specific
    assert abs(oth["cr"][8] - oth["universal"][8]) < 0.05, oth                  # ... and ~ universal elsewhere
    closed = "specific (closed form)"
    assert oth[closed][96] > 0.45 > oth["universal (closed form)"][96] + 0.2, oth  # the exact one plateaus
    c = res["results"][0][8]
    assert abs(c["universal"]["c"]["P_other"] - 1 / 8) < 0.01 and abs(c["specific"]["c"]["P_target"] - 1) < 0.02
    assert abs(c["cr"]["c"]["P_target"] - c["cr"]["c_theory"]["P_target"]) < 0.02, c["cr"]
    assert (out / "universality_m_sweep.png").is_file()


@pytest.mark.xfail(strict=True, reason="the TRAINED specific representation keeps ~1e-3 of its initial weight on the "
                                       "other tasks' private features (c_P_other = 0.001 after 600 steps), and ridge "
                                       "with a small lambda rescales it: other-task MSE 0.09 at m = 96, no plateau")
def test_trained_specific_representation_plateaus_on_other_tasks_under_ridge(sweep):
    res, _ = sweep
    assert _errors(res, "other")["specific"][96] > 0.45


def test_norm_constrained_probe_shows_the_trade_off(sweep):
    """With the paper's predictor class ||u|| <= B_phi,t (the least-norm best predictor of the representation's
    closed form: universal 2.12, specific 1.00 on its task and 0.71 elsewhere, where only S is encoded), the
    trained specific representation plateaus on the other task (measured 0.60 at m = 96; v2 + noise = 0.56) and
    wins on the target at small m (m = 8: specific 0.50, universal 0.78, CR 0.53; other task: universal 0.77,
    CR 0.77, specific 0.95)."""
    res, _ = sweep
    tgt, oth = _errors(res, "target", "errors_erm"), _errors(res, "other", "errors_erm")
    assert oth["specific"][96] > 0.45 and oth["universal"][96] < 0.15 and oth["cr"][96] < 0.15, oth
    assert tgt["universal"][8] - tgt["specific"][8] > 0.12 and tgt["universal"][8] - tgt["cr"][8] > 0.12, tgt
    assert oth["specific"][8] - oth["universal"][8] > 0.06 and abs(oth["cr"][8] - oth["universal"][8]) < 0.05, oth


@pytest.mark.parametrize("argv, option", [
    (["--seed", "1", "1"], "--seed"), (["--T", "1"], "--T"), (["--T", "4", "4"], "--T"), (["--m", "1"], "--m"),
    (["--repeats", "0"], "--repeats"), (["--gamma", "0"], "--gamma"), (["--gamma", "nan"], "--gamma"),
    (["--steps", "2"], "--steps"), (["--sweep-T", "1"], "--sweep-T"),
])
def test_bad_options_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert option in capsys.readouterr().err
