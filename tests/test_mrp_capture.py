"""The capture-probability study behind MRP's size rule (experiments/mrp_capture.py): what it records is the
module's own capture state, its shortcuts leave the dynamics alone, and the rule agrees with the committed curve."""
import argparse
import math

import pytest
import torch
from doc_claims import Claim, check_claims, load, require

from featlearn.experiments import mrp
from featlearn.experiments import mrp_capture as capture
from featlearn.experiments.common import build
from featlearn.experiments.study import Study

TABLE = "benchmarks/results/mrp/mrp_capture.json"
PAGE = "docs/methods/mrp.md"
# k = 4, d = 32, m = 4, seed 0 captures all 8 features by step 488 (measured when written): the stop at full
# capture is exercised, in ~20 s per fit on one thread
SIZE, SEED, HORIZON = mrp.size_rule(4, d=32, P=16, m=4), 0, 600


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("mrp_capture")
    try:
        with Study(argparse.Namespace(out=out, overwrite=False, seed=[SEED], horizon=HORIZON), "t", fits=1) as study:
            row = capture.fit_one(study, SIZE, SEED, HORIZON, "tiny")
        # the same run with the config's own logging (metrics every 10 steps, heat maps every 50)
        run = capture.pretrain_run(SIZE, SEED, HORIZON, "plain")
        argv = run.argv()
        for key in ("--trainer.log_every_n_steps", "--heatmap.every_n_steps"):
            i = argv.index(key)
            del argv[i:i + 2]
        cli = build(run.config, out, "plain", *argv)
        cli.trainer.fit(cli.model, cli.datamodule)
    finally:
        torch.set_num_threads(old)
    return row, out, cli


def test_recorded_capture_is_the_module_state(tiny):
    row, out, _ = tiny
    state = torch.load(out / "tiny" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    first = state["first_capture_step"]
    assert row["first capture steps"] == first.tolist()
    assert row["captured"] == int((first >= 0).sum()) == 2 * SIZE.k  # the case captures everything...
    assert row["all captured"] and row["frac captured at end"] == 1.0
    assert row["steps"] == int(first.max()) < HORIZON  # ...and stops at the step of the last capture


def test_sparse_logging_leaves_the_dynamics_alone(tiny):
    row, _, cli = tiny
    assert cli.model.first_capture_step.tolist() == row["first capture steps"]
    assert cli.trainer.global_step == row["steps"]


def test_wilson_interval():
    assert capture.wilson(0, 10)[0] == 0.0 and capture.wilson(10, 10)[1] == 1.0
    low, high = capture.wilson(5, 10)
    assert math.isclose(low + high, 1.0) and 0.2 < low < 0.25  # 0.237-0.763
    assert capture.wilson(9, 10)[0] < 0.9 < capture.wilson(9, 10)[1]


def test_points_are_refused_by_name(capsys):
    for bad in ("k7=4", "k8=", "k8=4,4", "k8=4@3", "k8=x"):
        with pytest.raises(SystemExit):
            capture.parse_args(["--points", bad, "--seed", "0", "1"])
        assert "--points" in capsys.readouterr().err


def test_rule_is_the_smallest_measured_m_with_capture_probability_0_9():
    table = load(TABLE)
    for k, by_m in table["points"].items():
        m = mrp.size_rule(int(k)).m
        assert str(m) in by_m, f"k = {k}: the rule's m = {m} was not measured"
        assert by_m[str(m)]["capture probability"] >= capture.TARGET, (k, m, by_m[str(m)])
        below = [int(x) for x, r in by_m.items() if int(x) < m and r["capture probability"] >= capture.TARGET]
        assert not below, f"k = {k}: m = {below} already reaches {capture.TARGET}, the rule's {m} is not the smallest"
        assert table["chosen"][k] == m


def _row(k: int, m: int) -> str:
    r = load(TABLE)["points"][str(k)][str(m)]
    rule = " (rule)" if m == mrp.size_rule(k).m else ""
    return (f"| {k} | {m}{rule} | {r['all captured']}/{r['seeds']} | {r['capture probability']:.2f} "
            f"({r['95% interval'][0]:.2f}-{r['95% interval'][1]:.2f}) | {r['mean share captured']:.3f} "
            f"({r['min share captured']:.3f}) |")


def _seed(k: int, m: int, seed: int) -> dict:
    return load(TABLE)["per_seed"][f"k{k}_m{m}"][str(seed)]


def _losers(k: int, m: int, expected: list[int]) -> dict:
    losers = [int(s) for s, r in load(TABLE)["per_seed"][f"k{k}_m{m}"].items() if not r["all captured"]]
    require(losers == expected, f"k = {k}, m = {m}: seeds {losers} miss a feature, the page names {expected}")
    return {}


CLAIMS = [Claim(PAGE, "{row}", lambda k=k, m=m: {"row": _row(k, m)})
          for k, ms in ((8, (4, 6, 8)), (10, (4, 6, 8)), (16, (7,))) for m in ms] + [
    Claim(PAGE, "k = 8, m = 6: seed 2 keeps {c} of 16 features", lambda: {"c": _seed(8, 6, 2)["captured"]}),
    Claim(PAGE, "k = 8, m = 6: seed 2", lambda: _losers(8, 6, [2])),
    Claim(PAGE, "k = 10, m = 6: seed 4 has {c} of 20 at the horizon, its last capture at step {s}",
          lambda: _losers(10, 6, [4]) | {"c": _seed(10, 6, 4)["captured"],
                                          "s": max(_seed(10, 6, 4)["first capture steps"])}),
    Claim(PAGE, "latest first-capture step of any run that captured everything is {s}", lambda: {"s": max(
        max(r["first capture steps"]) for rows in load(TABLE)["per_seed"].values() for r in rows.values()
        if r["all captured"])}),
]


def test_page_quotes_the_capture_table():
    check_claims(CLAIMS)


def _probabilities() -> dict:
    points = load(TABLE)["points"]
    return {"p8": f"{points['8']['6']['capture probability']:.2f}", "p10": f"{points['10']['6']['capture probability']:.2f}",
            "p16": f"{points['16']['7']['capture probability']:.2f}", "q8": f"{points['8']['4']['capture probability']:.2f}",
            "q10": f"{points['10']['4']['capture probability']:.2f}"}


def _m8_lost_nothing() -> dict:
    rows = [r for k in (8, 10) for r in load(TABLE)["per_seed"][f"k{k}_m8"].values()]
    require(all(r["all captured"] for r in rows), "a seed at m = 8 lost a feature")
    return {"n": len(rows)}


CLAIMS += [
    Claim(PAGE, "with probability {p8} at k = 8, {p10} at k = 10 and {p16} at k = 16, against {q8} at k = 8 and "
                "{q10} at k = 10 with m = 4", _probabilities),
    Claim(PAGE, "m = 8 lost no feature in {n} seeds at k = 8 and 10", _m8_lost_nothing),
]


def _cap_runs() -> dict:
    """The re-runs to the experiment's step cap, as the page lists them."""
    runs = load("benchmarks/results/mrp/mrp_capture_cap.json")["per_seed"]
    return {"runs": "; ".join(
        f"k = {point[1:point.index('_')]}, {point[point.index('_') + 1:].replace('m', 'm = ')}, seed {s}: "
        f"{r['captured']} of {r['features']} (last capture at step {max(r['first capture steps'])})"
        for point, rows in runs.items() for s, r in rows.items())}


CLAIMS += [Claim(PAGE, "{runs}", _cap_runs)]
