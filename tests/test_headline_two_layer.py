"""Headline claims of seed 003 chapter 2 through the experiment's own functions at a small size
(parity, d = 100, D = 100, k = 5, m = 50, n = 4,000, T = 150, seed 0, the experiment's lr3 grid chosen on
validation accuracy): the network's neurons align with sum_A M_j after two steps (CosSim > 0.99), and the
network beats the fixed features (NTK, RF) on test accuracy.

Measured (2 threads shared, this size): Network test 73.2% (lr3 x1; x100 49.5%), NTK 76.8% (x1), RF 72.3%
(x100); CosSim after step 2 0.993, RF (init) 0.273. The accuracy claim fails at this size under the
theory's schedule: the network stops at the 'S > k/2' threshold solution (the same as the full-size run,
see the README section), so it is a strict xfail that says so."""
import argparse
from pathlib import Path

import pytest

from featlearn.experiments.two_layer import SETTINGS, parse_args, run_one

pytestmark = pytest.mark.usefixtures("one_thread")

SETTING = {"name": "small", "data": "data_parity.yaml", "dim": 100, "width": 50, "steps": 150}


def _best(label: str, tmp_path: Path) -> dict:
    args = argparse.Namespace(width=None, steps=None, num_train=4000, out=tmp_path)
    trials = [run_one(SETTING, SETTINGS["methods"][label], 0, lr, args, f"{label}_{lr}")[2]
              for lr in SETTINGS["lr3_grid"]]
    return max(trials, key=lambda r: r["val"])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_layer_headline")
    return {label: _best(label, root) for label in ("Network", "NTK", "RF")}


def test_neurons_align_with_the_relevant_patterns(results):
    assert results["Network"]["cos"] > 0.99
    assert results["RF"]["cos"] < 0.5              # random features stay where they started


@pytest.mark.xfail(strict=True, reason="measured at this size: Network 73.2% < NTK 76.8% test accuracy; the "
                                       "theory's schedule stops at the threshold solution (module docstring)")
def test_network_beats_fixed_features(results):
    assert results["Network"]["test"] > max(results["NTK"]["test"], results["RF"]["test"]) + 2.0


@pytest.mark.parametrize("argv, option", [
    (["--table", "A9"], "--table"), (["--lr3-grid", "0"], "--lr3-grid"), (["--num-train", "-3"], "--num-train"),
    (["--steps", "2"], "--steps"), (["--seed", "1", "1"], "--seed"), (["--methods", "SVM"], "--methods"),
])
def test_bad_options_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert option in capsys.readouterr().err
