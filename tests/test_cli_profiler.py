"""The CLI's default profiler records nothing at no cost per hook; a profiler the run asks for is kept."""
from lightning.pytorch.profilers import SimpleProfiler

from featlearn.cli import NoOpProfiler, make_cli

CONFIG = ["--config", "configs/noncontrastive/with_head_population.yaml", "--trainer.logger", "false",
          "--trainer.accelerator", "cpu"]


def test_a_run_without_a_profiler_gets_the_no_op_one_and_its_hooks_run(tmp_path):
    cli = make_cli([*CONFIG, "--trainer.max_steps", "3", "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert type(cli.trainer.profiler) is NoOpProfiler
    ran = []
    with cli.trainer.profiler.profile("[Callback]x.on_train_batch_end"):
        ran.append(True)
    assert ran == [True]
    cli.trainer.fit(cli.model, cli.datamodule)  # every hook goes through it
    assert cli.trainer.global_step == 3


def test_a_profiler_the_run_sets_is_kept(tmp_path):
    cli = make_cli([*CONFIG, "--trainer.profiler", "simple", "--trainer.max_steps", "3",
                    "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert isinstance(cli.trainer.profiler, SimpleProfiler)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert "run_training_batch" in cli.trainer.profiler.recorded_durations  # it measured the steps

