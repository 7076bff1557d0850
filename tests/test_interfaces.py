"""The interfaces every method shares: declared DataModule pairing, what a run shows in TensorBoard
(heat-map figures, HPARAMS with results and without private keys), the step progress bar, and the
command line every experiment starts from."""
import importlib
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from featlearn.cli import main, make_cli
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.experiments.common import experiment_parser, parse_experiment_args, resolved_config

ROOT = Path(__file__).resolve().parents[1]
# run configs: a model of their own or a ``config:`` base (data presets and experiment settings are not runs)
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if {"model", "config"} & set(yaml.safe_load(p.read_text())))


def _class(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_pairs_the_declared_datamodule(config):
    resolved = resolved_config(config.relative_to(ROOT / "configs"))
    model, data = _class(resolved["model"]["class_path"]), _class(resolved["data"]["class_path"])
    assert model.datamodule_class is not SyntheticDataModule, f"{model.__name__} declares no datamodule_class"
    assert data is model.datamodule_class


def test_a_module_refuses_another_datamodule(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "mixed.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 1, "logger": False},
        "model": {"class_path": "featlearn.lightning_modules.mrp.MaskedAutoencoderMRP"},
        "data": {"class_path": "featlearn.datamodules.sparse_coding.SparseCodingDataModule",
                 "init_args": {"d": 16, "d1": 64, "batch_size": 32, "num_negatives": 32, "mode": "online"}}}))
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(config)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert "data.class_path: must be featlearn.datamodules.multiview.MultiViewDataModule" in err
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_run_shows_figures_results_and_clean_hparams(tmp_path, one_thread, monkeypatch):
    from featlearn.callbacks import progress
    from featlearn.metrics.figures import plt

    monkeypatch.setattr(progress, "REDRAW_SECONDS", 1e9)  # so the bar redraws at the first and last steps only
    open_figures = set(plt.get_fignums())
    cli = make_cli(["--config", str(ROOT / "configs/mrp/mae.yaml"), "--trainer.max_steps", "4",
                    "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.version", "v",
                    "--heatmap.every_n_steps", "2", "--trainer.enable_model_summary", "false"], run=False)
    bar = cli.trainer.progress_bar_callback
    draws = []
    monkeypatch.setattr(type(bar), "get_metrics", lambda self, *a: draws.append(1) or {})
    cli.trainer.fit(cli.model, cli.datamodule)
    monkeypatch.undo()
    assert len(draws) == 3, "a redraw per step, not throttled (first step, last step, end of fit)"
    assert set(plt.get_fignums()) == open_figures, "the heat maps' figures outlived the fit"
    assert type(bar).__name__ == "StepProgressBar" and bar.total_train_batches == 4
    assert bar.train_progress_bar.n == 4  # steps, not batches of the current epoch
    assert "loss" in bar.get_metrics(cli.trainer, cli.model)  # the training loss, for every method alike

    run = next(tmp_path.rglob("hparams.yaml")).parent
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert not [k for k in hparams if k.startswith("_")], "LightningCLI bookkeeping leaked into hparams.yaml"
    assert hparams["data.k"] == 10 and hparams["q"] == 4  # the data's arguments beside the model's

    events = EventAccumulator(str(run))
    events.Reload()
    frames = events.Images("heatmap/correlation")  # steps 2 and 4, and the end of fit
    assert [f.step for f in frames] == [2, 4, 4]
    results = [t for t in events.Tags()["scalars"] if t.startswith("hp/")]
    assert results, "final_metrics() reached no hp/ scalar"
    assert "hp_metric" not in events.Tags()["scalars"]


def test_experiment_command_line(tmp_path, capsys):
    parser = experiment_parser("demo", str(tmp_path / "out"))
    args = parse_experiment_args(parser, ["--seed", "3", "1"])
    assert args.seed == [3, 1] and args.out == tmp_path / "out" and args.out.is_dir()
    (args.out / "table.md").write_text("x")
    assert parse_experiment_args(parser, []).out == tmp_path / "out"  # the Study chooses the folder, not the parser
    with pytest.raises(SystemExit):
        parse_experiment_args(parser, ["--seed", "1", "1"])
    assert "--seed: seeds must be distinct" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_experiment_args(parser, ["--threads", "0"])


def test_the_bar_ends_at_the_last_step_when_epochs_stop_the_run(tmp_path, one_thread, monkeypatch):
    from featlearn.callbacks import progress

    monkeypatch.setattr(progress, "REDRAW_SECONDS", 1e9)  # no redraw between the first step and the end
    cli = make_cli(["--config", str(ROOT / "configs/mrp/mae.yaml"), "--trainer.max_steps", "50", "--trainer.max_epochs",
                    "3", "--trainer.logger.init_args.save_dir", str(tmp_path),
                    "--trainer.enable_model_summary", "false"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 3 and cli.trainer.progress_bar_callback.train_progress_bar.n == 3


def test_a_heat_map_frame_shows_the_new_values_on_the_reused_figure():
    """The figure is laid out once and redrawn: the second frame must show the second matrix, not the first."""
    import torch
    from torch.utils.tensorboard._utils import figure_to_image

    from featlearn.metrics.figures import HeatmapFrames, plt

    before = set(plt.get_fignums())
    frames, args = HeatmapFrames(), dict(xlabel="feature", ylabel="neuron", vmax=1.0, title="same title")
    first = frames.figure("c", torch.eye(3), **args)
    image_first = figure_to_image(first, close=False).copy()
    second = frames.figure("c", -torch.eye(3), **args)
    assert second is first
    assert torch.equal(torch.as_tensor(second.axes[0].images[0].get_array()), -torch.eye(3, dtype=torch.float64))
    assert (figure_to_image(second, close=False) != image_first).any()  # same title: only the data can differ
    third = frames.figure("c", torch.eye(4), **args)  # a new shape: a new figure, the old one closed
    assert third is not first and set(plt.get_fignums()) - before == {third.number}
    frames.close()
    assert set(plt.get_fignums()) == before


def test_two_runs_without_a_logger_in_one_folder(tmp_path, one_thread, monkeypatch):
    """Without a logger the config is saved as ./config.yaml; the second run replaces it (it stopped with
    SaveConfigCallback's RuntimeError traceback)."""
    monkeypatch.chdir(tmp_path)
    for steps in ("1", "2"):
        main(["fit", "--config", str(ROOT / "configs/mrp/mae.yaml"), "--trainer.max_steps", steps, "--trainer.logger",
              "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])
    assert "max_steps: 2" in (tmp_path / "config.yaml").read_text()
