"""Several seeds of an experiment's run in one fit (``Study.fit_seeds``): each seed's result is the one its own fit
gives (tested, checkpointed, counted), it is kept as a fit of its own so a study resumes seed by seed, a seed that
diverges is a result, and ``{seed}`` in a setting is each seed's own value (a checkpoint to start from)."""
import argparse
import json

import pytest
import torch
from test_seeds import _Poison
from test_tensorboard_server import METHODS

from featlearn.experiments import study as engine
from featlearn.experiments.common import build
from featlearn.experiments.study import Run, Study, final_metrics

CONFIG, TINY = METHODS["contrastive"][0], METHODS["contrastive"][1]
SETTINGS = {**dict(zip((k.removeprefix("--") for k in TINY[::2]), TINY[1::2])), "trainer.max_steps": 3}


def _args(out, seeds):
    return argparse.Namespace(out=out, overwrite=False, threads=1, seed=seeds)


def _collect(fitted):
    loops = {"test": fitted.test(), "val": fitted.validate()}  # first: for several seeds they run for all at once
    return {**final_metrics(fitted), **loops, "checkpoint": fitted.checkpoint}


def _flat(result: dict, prefix: str = "") -> dict:
    """A result's numbers by dotted key (pytest.approx takes no nested dicts)."""
    out = {}
    for key, value in result.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_each_seed_of_a_stacked_fit_is_its_own_fit(tmp_path, monkeypatch, one_thread):
    out = tmp_path / "study"
    with Study(_args(out, [3, 5]), "demo", fits=4) as study:
        together = study.fit_seeds(Run(CONFIG, "both", SETTINGS), [3, 5], _collect)
        alone = {s: study.fit(Run(CONFIG, f"alone{s}", SETTINGS, seed=s), _collect) for s in (3, 5)}
        assert study.progress.fits.n == 4
    for s in (3, 5):  # a stack vmaps contrastive learning's loss: equal to float rounding at this size
        got, want = dict(together[s]), dict(alone[s])
        path = got.pop("checkpoint")
        assert path == str(out / "both" / f"seed_{s}" / "last.ckpt") and torch.load(path, weights_only=False)["seed"] == s
        want.pop("checkpoint")
        # the probes' solves amplify the weights' rounding (2e-5 after 3 steps); the tables round to 4 digits
        assert _flat(got) == pytest.approx(_flat(want), rel=1e-4, abs=2e-4)
        assert got["steps"] == 3 and got["test"] and got["val"]  # each seed's own loops' logs
        assert not [k for k in got["test"] if k.startswith("val/")]  # no validation value leaks into the test's
    assert together[3] != together[5]
    runs = json.loads((out / "study.json").read_text())["runs"]
    assert runs["both/seed_5"]["run"] == Run(CONFIG, "both/seed_5", SETTINGS, seed=5).spec()

    built = []
    real = engine.build
    monkeypatch.setattr(engine, "build", lambda *a: built.append(a) or real(*a))
    with Study(_args(out, [3, 5]), "demo", fits=3) as again:  # resumed: only the new seed is fitted
        more = again.fit_seeds(Run(CONFIG, "both", SETTINGS), [3, 5, 7], _collect)
        assert again.progress.fits.n == 3
    assert len(built) == 1 and built[0][-2:] == ("--seeds", "[7]")
    assert more[3] == together[3] and more[5] == together[5] and more[7]["steps"] == 3
    assert (out / "both" / "seed_3" / "last.ckpt").is_file()  # the kept seeds' files stay, and the first stack's
    assert len(list((out / "both").glob("events.out.tfevents.*"))) == 2  # run-level logs (seed 3's heat maps)


def test_a_seed_that_diverges_is_a_result_and_the_others_go_on(tmp_path, monkeypatch, one_thread):
    real = engine.build

    def poisoned(*args):
        cli = real(*args)
        cli.trainer.callbacks.append(_Poison(row=1, at=2))
        return cli
    monkeypatch.setattr(engine, "build", poisoned)
    with Study(_args(tmp_path / "s", [0, 1, 2]), "demo", fits=3) as study:
        results = study.fit_seeds(Run(CONFIG, "poisoned", {**SETTINGS, "trainer.max_steps": 6}), [0, 1, 2])
    assert results[1]["diverged"] is True and "lower model.init_args.lr" in results[1]["error"], results[1]
    assert "seed_1/before_divergence.ckpt" in results[1]["error"]
    assert results[0]["steps"] == results[2]["steps"] == 6 and "diverged" not in results[0]

    monkeypatch.setattr(engine, "build", real)
    blowup = {**SETTINGS, "trainer.max_steps": 200, "model.init_args.lr": 1e6}
    with Study(_args(tmp_path / "b", [0, 1]), "demo", fits=2) as study:  # every seed: still results, not a crash
        results = study.fit_seeds(Run(CONFIG, "blowup", blowup), [0, 1])
    assert all(results[s]["diverged"] and "lower model.init_args.lr" in results[s]["error"] for s in (0, 1))


def test_seed_in_a_setting_is_each_seeds_own(tmp_path, one_thread):
    run = Run("universality/cr.yaml", "cr", {"model.init_args.reference": "runs/u/seed_{seed}/last.ckpt"}, seed=4)
    assert run.settings()["model.init_args.reference"] == "runs/u/seed_4/last.ckpt"
    with pytest.raises(ValueError, match="without a seed"):
        Study(_args(tmp_path / "s", [0]), "demo", fits=1).fit_seeds(run, [0])

    small = ["--trainer.max_steps", "2", "--data.init_args.batch_size", "128", "--data.init_args.num_test", "100",
             "--model.init_args.probe_repeats", "2"]
    universal = build("universality/universal.yaml", tmp_path, "u", *small, "--seeds", "[0, 1]")
    universal.trainer.fit(universal.model, universal.datamodule)
    template = str(tmp_path / "u" / "seed_{seed}" / "last.ckpt")
    cr = build("universality/cr.yaml", tmp_path, "cr", *small, "--model.init_args.reference", template,
               "--seeds", "[0, 1]")
    for row in (0, 1):  # each seed starts its trust region at its own universal W
        torch.testing.assert_close(cr.model.members[row].cr.ref_w, universal.model.members[row].w.detach())
    assert not torch.equal(cr.model.members[0].cr.ref_w, cr.model.members[1].cr.ref_w)
    cr.trainer.fit(cr.model, cr.datamodule)
    saved = (tmp_path / "cr" / "config.yaml").read_text()
    assert "seed_{seed}" in saved  # the run's config keeps the template
    alone = build("universality/cr.yaml", tmp_path, "cr1", *small, "--model.init_args.reference", template,
                  "--seed_everything", "1")  # one seed: its seed_everything
    alone.model.attach(alone.datamodule)
    torch.testing.assert_close(alone.model.cr.ref_w, universal.model.members[1].w.detach())
