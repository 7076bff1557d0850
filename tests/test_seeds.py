"""Several seeds in one run (``lightning fit --seeds``): each seed ends where its own run ends (bit for bit where
its members run their own steps, to float rounding where the loss is vmapped), a seed that diverges stops alone
and keeps its state from before, each seed gets its own TensorBoard run and checkpoint, bad values are refused."""
import inspect
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_tensorboard_server import METHODS

from featlearn.cli import main, make_cli
from featlearn.errors import ConfigError
from featlearn.lightning_modules.base import FeatureLearningModule

TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12)}  # float32: torch's defaults (1.3e-6, 1e-5)
# vmapped losses (contrastive and universality with one draw of every seed's batch, the population loss) and the
# members' own steps in turn (the sampled non-contrastive loss's fused kernels): bit for bit
FAST = ("contrastive", "noncontrastive_population", "universality", "noncontrastive")
SEEDS = [3, 5]


def _args(key: str, out, steps: int = 4) -> list[str]:
    config, tiny, *_ = METHODS[key]
    return ["fit", "--config", f"configs/{config}", *tiny, "--trainer.max_steps", str(steps),
            "--trainer.log_every_n_steps", "2", "--trainer.logger.init_args.save_dir", str(out),
            "--trainer.enable_progress_bar", "false"]


def _alone(key: str, out, seed: int, steps: int = 4):
    """The method fitted alone at ``seed``, as ``--seeds`` builds each of its seeds."""
    args = [*_args(key, out, steps), "--seed_everything", str(seed), "--data.init_args.seed", str(seed)]
    return make_cli(args + _model_seed(key, seed)).model


def _model_seed(key: str, seed: int) -> list[str]:
    probe = make_cli(["--config", f"configs/{METHODS[key][0]}", *METHODS[key][1]], run=False)
    takes_seed = "seed" in inspect.signature(type(probe.model).__init__).parameters
    return ["--model.init_args.seed", str(seed)] if takes_seed else []


REFUSED = ("gemfilter",)  # overrides a Lightning hook the stack does not forward (test_a_method_...)


@pytest.mark.parametrize("key", [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in METHODS
                                 if k not in REFUSED])
def test_each_seed_ends_where_its_own_run_ends(key, tmp_path):
    stack = make_cli([*_args(key, tmp_path), "--seeds", str(SEEDS)]).model
    for row, seed in enumerate(SEEDS):
        one = _alone(key, tmp_path, seed)
        for name, leaf in zip(stack.names, stack.stacked):
            mine, theirs = leaf.detach()[row], one.get_parameter(name).detach()
            if stack.batched:  # the same arithmetic in batched ops: equal to rounding
                torch.testing.assert_close(mine, theirs, **TOLERANCE.get(mine.dtype, {}))
            else:
                assert torch.equal(mine, theirs), (key, seed, name, float((mine - theirs).abs().max()))
        assert stack.members[row].final_metrics().keys() == one.final_metrics().keys()
        if not stack.batched:
            assert stack.members[row].final_metrics() == one.final_metrics()


class _Poison(L.Callback):
    """Turns seed row ``row``'s weights to NaN after step ``at``: that seed diverges, the others must not notice."""

    def __init__(self, row: int, at: int):
        self.row, self.at = row, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            with torch.no_grad():
                pl_module.stacked[0][self.row] = float("nan")


def test_a_diverged_seed_stops_alone_and_keeps_its_state(tmp_path):
    seeds, steps = [0, 1, 2], 8
    args = _args("noncontrastive_population", tmp_path, steps)
    cli = _fit_with(args + ["--seeds", str(seeds)], _Poison(row=1, at=5))
    stack, log_dir = cli.model, cli.trainer.log_dir
    assert stack.alive == [True, False, True]
    # poisoned after step 5, read at the check after step 6 (log_every_n_steps = 2), judged step by step
    assert stack.guard.stopped[1] == "diverged: train loss is not finite at step 6"
    w1 = stack.stacked[0].detach()[1]
    saved = torch.load(f"{log_dir}/seed_1/before_divergence.ckpt", weights_only=True)
    assert saved["weights_step"] == 4                   # the last check before the damage
    assert torch.equal(saved["state_dict"]["w"], w1)     # held there since
    alone = _alone("noncontrastive_population", tmp_path, 1, 4)
    torch.testing.assert_close(w1, alone.w.detach(), rtol=1e-10, atol=1e-12)
    for row, seed in ((0, 0), (2, 2)):                    # the others went on, as if alone
        one = _alone("noncontrastive_population", tmp_path, seed, steps)
        torch.testing.assert_close(stack.stacked[0].detach()[row], one.w.detach(), rtol=1e-10, atol=1e-12)
    events = EventAccumulator(f"{log_dir}/seed_2", size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 3, 5, 7]
    assert "hp/final_loss" in events.Tags()["scalars"]
    assert not Path(log_dir, "seed_1", "last.ckpt").exists() and Path(log_dir, "seed_0", "last.ckpt").exists()
    # a seed's own checkpoint is a checkpoint of the method: validate reads it
    main(["validate", "--config", "configs/noncontrastive/with_head_population.yaml", *METHODS[
        "noncontrastive_population"][1], "--trainer.logger", "false", "--data.init_args.seed", "2",
          "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", f"{log_dir}/seed_2/last.ckpt"])
    # and fit resumes the diverged seed alone from its checkpoint, with a smaller step size
    resumed = make_cli([*_args("noncontrastive_population", tmp_path, steps + 2), "--seed_everything", "1",
                        "--data.init_args.seed", "1", "--model.init_args.lr", "0.01",
                        "--ckpt_path", f"{log_dir}/seed_1/before_divergence.ckpt"])
    assert resumed.trainer.global_step == steps + 2 and torch.isfinite(resumed.model.w).all()


def _fit_with(args: list[str], callback: L.Callback):
    """``make_cli(args)`` with one more callback in its Trainer."""
    fit = L.Trainer.fit

    def with_callback(trainer, *a, **k):
        trainer.callbacks.append(callback)
        return fit(trainer, *a, **k)

    with mock.patch.object(L.Trainer, "fit", with_callback):
        return make_cli(args)


@pytest.mark.parametrize("argv, words", [
    (["--seeds", "[1, 1]"], "seeds: must be a non-empty list of distinct seeds in [0, 2^32), got [1, 1]"),
    (["--seeds", "[-1]"], "seeds: must be a non-empty list of distinct seeds in [0, 2^32), got [-1]"),
    (["--seeds", "[]"], "seeds: must be a non-empty list of distinct seeds in [0, 2^32), got []"),
    (["--seeds", "[1, x]"], "seeds: must be of type"),
    (["--seeds", "[1, 2]", "--trainer.gradient_clip_val", "1.0"], "trainer.gradient_clip_val: must be null with"),
    (["--seeds", "[1, 2]", "--trainer.strategy", "ddp_spawn"], "trainer.strategy: must be auto or ddp with"),
])
def test_bad_seeds_are_refused(argv, words, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*_args("noncontrastive_population", tmp_path), *argv])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("key", REFUSED)
def test_a_method_with_a_hook_the_stack_cannot_forward_is_refused(key, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*_args(key, tmp_path), "--seeds", "[1, 2]"])
    assert exit_.value.code == 2
    assert "seeds: must be a method whose Lightning hooks a stack forwards" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["contrastive", *[pytest.param(k, marks=pytest.mark.slow) for k in (
    "mrp_teacher_student", "vit_mae", "noncontrastive_population", "two_layer")], "universality"])
def test_a_run_of_several_seeds_resumes_where_it_stopped(key, tmp_path, capsys):
    """The run's own last.ckpt holds every seed: 3 steps, then resumed to 6, ends where 6 steps in one go end."""
    seeds = ["--seeds", "[2, 9]"]
    whole = make_cli([*_args(key, tmp_path / "whole", 6), *seeds]).model
    first = make_cli([*_args(key, tmp_path / "cut", 3), *seeds])
    ckpt = first.trainer.checkpoint_callback.last_model_path
    resumed = make_cli([*_args(key, tmp_path / "cut", 6), *seeds, "--ckpt_path", ckpt]).model
    for a, b in zip(whole.stacked, resumed.stacked):
        assert torch.equal(a.detach(), b.detach())
    if key == "contrastive":  # the members' own checkpoint state (their stage clocks)
        assert [m.T1 for m in whole.members] == [m.T1 for m in resumed.members]
    with pytest.raises(SystemExit):  # the checkpoint's seeds, in their order, or a clear refusal
        main([*_args(key, tmp_path / "cut", 6), "--seeds", "[9, 2]", "--ckpt_path", ckpt])
    assert "seeds: must be the seeds of the checkpoint, [2, 9], in that order, got [9, 2]" in capsys.readouterr().err


def test_the_progress_bar_shows_the_mean_loss_of_the_seeds(tmp_path):
    args = [a for a in _args("noncontrastive_population", tmp_path) if a not in ("--trainer.enable_progress_bar",
                                                                                 "false")]
    cli = make_cli([*args, "--seeds", "[0, 1, 2]"])
    bar = next(c for c in cli.trainer.callbacks if type(c).__name__ == "StepProgressBar")
    losses = [float(m.last_loss) for m in cli.model.members]
    assert bar._loss == pytest.approx(sum(losses) / 3, rel=1e-12) and len(set(losses)) == 3


def test_seeds_whose_schedules_differ_need_an_optimizer_with_per_row_values():
    """Seed-dependent step sizes: a tuple per entry (row s: seed s) for ScheduledGD, whose update of row s is seed
    s's own update bit for bit; a clear refusal naming --seeds for an optimizer with one value per group."""
    from featlearn.lightning_modules.seed_schedules import prepare_seeds
    from featlearn.lightning_modules.two_layer_parts import ScheduledGD

    class Member(FeatureLearningModule):
        def __init__(self, lr):
            super().__init__()
            self.lr = lr

        def prepare_step(self, optimizer):
            for group in optimizer.param_groups:
                group["lr"], group["decay"] = self.lr, 0.5

    weights = torch.randn(3, 4, 5, dtype=torch.float64)
    stacked = torch.nn.Parameter(weights.clone())
    stacked.grad = torch.randn_like(weights)
    optimizer = ScheduledGD([stacked])
    prepare_seeds([Member(0.1), Member(0.1), Member(0.3)], optimizer, [0, 1, 2])
    assert optimizer.param_groups[0]["lr"] == (0.1, 0.1, 0.3) and optimizer.param_groups[0]["decay"] == 0.5
    optimizer.step()
    for row, lr in enumerate((0.1, 0.1, 0.3)):
        alone = torch.nn.Parameter(weights[row].clone())
        alone.grad = stacked.grad[row].clone()
        solo = ScheduledGD([alone])
        Member(lr).prepare_step(solo)
        solo.step()
        assert torch.equal(stacked.detach()[row], alone.detach()), row
    with pytest.raises(ConfigError, match="seeds: must be seeds whose Member schedules agree: 'lr' differs"):
        prepare_seeds([Member(0.1), Member(0.3)], torch.optim.SGD([stacked], lr=0.1), [0, 1])
