"""DivergenceGuard: blow-ups stop at once with the step, the quantity and the fix; the checkpoint kept
predates the blow-up; resuming it with a smaller learning rate uses that learning rate."""
import lightning as L
import pytest
import torch

from featlearn.callbacks import DivergenceGuard, FinalCheckpoint
from featlearn.cli import main
from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.errors import DivergenceError
from featlearn.lightning_modules.contrastive import ContrastiveModule
from featlearn.lightning_modules.mrp import TeacherStudentMRP
from featlearn.lightning_modules.multiview_classifier import MultiViewClassifier
from featlearn.lightning_modules.noncontrastive import NonContrastiveModule

# the cases: each ran on (to |w| ~ 1e18-6e28) before the guard watched growth
BLOWUPS = {
    "mrp_literal_lr1e8": lambda: (TeacherStudentMRP(m=2, lr=1e8, norm_cap=None, backend="torch"),
                                  MultiViewDataModule(k=4, d=32, P=8, s=1.0, num_pretrain=64, seed=1)),
    "supervised_lr1e8": lambda: (MultiViewClassifier(m=2, lr=1e8, backend="torch"),
                                 MultiViewDataModule(k=4, d=32, P=8, s=1.0, num_downstream=64, seed=1)),
    "contrastive_lr1e12": lambda: (ContrastiveModule(lr=1e12, backend="torch"),
                                   SparseCodingDataModule(d=16, d1=64, batch_size=32, num_negatives=32)),
    "noncontrastive_population_lr1e30": lambda: (
        NonContrastiveModule(width=2, lr=1e30, gradient="population", backend="torch"),
        TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=2)),
}


def fit(model, dm, steps, callbacks, root):
    L.Trainer(max_steps=steps, max_epochs=-1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=callbacks, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root,
              enable_checkpointing=any(isinstance(c, FinalCheckpoint) for c in callbacks)).fit(model, dm)


@pytest.mark.parametrize("case", list(BLOWUPS))
def test_blowup_stops_naming_step_quantity_and_fix(tmp_path, case, one_thread):
    L.seed_everything(0)
    model, dm = BLOWUPS[case]()
    with pytest.raises(DivergenceError) as err:
        fit(model, dm, 50, [DivergenceGuard()], tmp_path)
    message = str(err.value)
    assert "global step 1 " in message or "global step 2 " in message, message
    assert ("weight norm" in message or "loss" in message) and "limit" in message and "learning rate" in message


def test_normal_runs_are_not_stopped(tmp_path, one_thread):
    for make in (lambda: (TeacherStudentMRP(m=2, backend="torch", stop_after_capture=None),
                          MultiViewDataModule(k=4, d=32, P=8, s=1.0, num_pretrain=64, seed=1)),
                 lambda: (NonContrastiveModule(width=2, gradient="population", backend="torch"),
                          TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=2))):
        model, dm = make()
        fit(model, dm, 60, [DivergenceGuard()], tmp_path)
        assert model.trainer.global_step == 60


def test_factor_comes_from_the_method_unless_set():
    assert DivergenceGuard().factors(TeacherStudentMRP()) == {"weight_norm": 10.0}
    assert DivergenceGuard().factors(ContrastiveModule()) == {"loss": 100.0, "weight_norm": 1000.0}
    assert DivergenceGuard(weight_growth=3.0).factors(TeacherStudentMRP()) == {"weight_norm": 3.0}


def test_kept_checkpoint_predates_the_blowup_and_resumes_with_a_new_lr(tmp_path, capsys):
    # the literal teacher-student dynamics (no norm cap) blow up after ~80 steps at lr 5, growing
    # steadily: a checkpoint every step would keep a state deep into the growth without the guard
    tiny = ["--data.init_args.num_pretrain", "64", "--trainer.enable_progress_bar", "false",
            "--trainer.logger", "false", "--checkpoint.dirpath", str(tmp_path), "--checkpoint.every_n_train_steps", "1"]
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/mrp/teacher_student.yaml", "--model.init_args.norm_cap", "null", *tiny,
              "--trainer.default_root_dir", str(tmp_path / "first")])
    message = str(stop.value.code)
    assert "diverged at global step" in message and "weight norm" in message and "--ckpt_path" in message
    diverged_at = int(message.split("global step ")[1].split()[0])
    kept = torch.load(tmp_path / "last.ckpt", weights_only=False)
    history = kept["callbacks"]["DivergenceGuard"]["history"]
    smallest = min(v["weight_norm"] for _, v in history)
    kept_norm = kept["state_dict"]["weight"].norm().item()
    assert kept["global_step"] < diverged_at - 1                      # saves were held back during the growth
    assert kept_norm <= 10 ** 0.5 * smallest + 1e-9                   # below the watch level at the save
    # resume with a smaller learning rate: the config's lr replaces the checkpoint's optimizer lr
    resumed_steps = kept["global_step"] + 20
    main(["fit", "--config", "configs/mrp/teacher_student.yaml", "--model.init_args.norm_cap", "null",
          "--model.init_args.lr", "0.05", "--ckpt_path", str(tmp_path / "last.ckpt"),
          "--trainer.max_steps", str(resumed_steps), *tiny, "--trainer.default_root_dir", str(tmp_path / "resumed")])
    final = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert final["global_step"] == resumed_steps > diverged_at        # went on past the old blow-up step
    assert final["optimizer_states"][0]["param_groups"][0]["lr"] == 0.05


# --- the checks stay on the device; read every check_every_n_steps steps --------------------------------
def tiny_literal_mrp():
    """The literal teacher-student dynamics (no norm cap) at the shipped lr: they grow steadily and blow
    up after ~80 steps, with a suspect stretch before (configs/mrp/teacher_student.yaml, 64 samples)."""
    data = MultiViewDataModule(k=10, d=256, P=16, C_p=1, s=2.0, mu=0.02, rho=0.1, sigma_p=0.005, gamma=0.002,
                               num_pretrain=64, num_downstream=64, num_test=64, seed=0)
    return TeacherStudentMRP(theta=0.5, q=3, rho=0.25, sigma0=0.02, m=6, lr=5.0, norm_cap=None,
                             stop_after_capture=None, backend="torch"), data


def head(message: str) -> str:
    """The step, the epoch and what diverged, without the notes that depend on when it was read."""
    return message.split(". ")[0]


@pytest.mark.parametrize("case", list(BLOWUPS))
def test_the_interval_changes_when_a_blowup_is_read_not_what_is_found(tmp_path, case, one_thread):
    messages = {}
    for every in (1, None):  # None: the trainer's log_every_n_steps (50 here)
        L.seed_everything(0)
        model, dm = BLOWUPS[case]()
        with pytest.raises(DivergenceError) as err:
            fit(model, dm, 50, [DivergenceGuard(check_every_n_steps=every)], tmp_path)
        messages[every] = (str(err.value), model.trainer.global_step)
    (once, stopped_once), (later, stopped_later) = messages[1], messages[None]
    assert head(later) == head(once), (once, later)
    assert stopped_once in (1, 2) and stopped_later == 50       # read at step 50, named where it began
    assert "Read at step 50" in later and "Read at step" not in once


def test_kept_checkpoint_and_stop_are_the_same_whatever_the_interval(tmp_path, one_thread):
    # saves every 3 steps are postponed while the run is suspect: every save first reads the kept steps,
    # and a postponed save has the guard read every step, so the kept checkpoint is the one of interval 1
    found = {}
    for every in (1, 10):
        L.seed_everything(0)
        model, dm = tiny_literal_mrp()
        root = tmp_path / str(every)
        ckpt = FinalCheckpoint(dirpath=root, save_last=True, every_n_train_steps=3, save_top_k=0, monitor=None)
        with pytest.raises(DivergenceError) as err:
            L.Trainer(max_steps=300, max_epochs=-1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, log_every_n_steps=50, limit_val_batches=0, num_sanity_val_steps=0,
                      callbacks=[DivergenceGuard(check_every_n_steps=every), ckpt],
                      default_root_dir=root).fit(model, dm)
        found[every] = (head(str(err.value)), torch.load(root / "last.ckpt", weights_only=False))
    (message, kept), (message_10, kept_10) = found[1], found[10]
    assert message == message_10 and "weight norm" in message
    diverged_at = int(message.split("global step ")[1].split()[0])
    assert kept["global_step"] == kept_10["global_step"] < diverged_at - 3   # held back during the growth
    assert kept["callbacks"]["DivergenceGuard"] == kept_10["callbacks"]["DivergenceGuard"]
    for key, value in kept["state_dict"].items():
        torch.testing.assert_close(kept_10["state_dict"][key], value, rtol=0, atol=0, msg=key)


class _Counting(DivergenceGuard):
    """Counts, per global step, the host reads made inside the guard's per-step hooks."""

    READS = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")

    def __init__(self, monkeypatch, **kw):
        super().__init__(**kw)
        self.reads, self._at = {}, None
        for name in self.READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                if self._at is not None:
                    self.reads.setdefault(self._at, []).append(_name)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def _counted(self, hook, trainer, *args):
        self._at = trainer.global_step if hook == "on_train_batch_end" else trainer.global_step + 1
        try:
            return getattr(super(), hook)(trainer, *args)
        finally:
            self._at = None

    def on_before_backward(self, trainer, *args):
        return self._counted("on_before_backward", trainer, *args)

    def on_train_batch_end(self, trainer, *args):
        return self._counted("on_train_batch_end", trainer, *args)


@pytest.mark.parametrize("every", [None, 1])
def test_a_step_makes_no_host_sync_between_reads(tmp_path, monkeypatch, every, one_thread):
    # contrastive logs prog_bar metrics on log steps: trainer.callback_metrics would turn them into Python
    # numbers (.item()) on every later read of the property; the guard reads the logged tensors instead
    L.seed_everything(0)
    guard = _Counting(monkeypatch, check_every_n_steps=every)
    model, dm = ContrastiveModule(lr=0.5, backend="torch"), SparseCodingDataModule(d=16, d1=64, batch_size=32,
                                                                                  num_negatives=32)
    L.Trainer(max_steps=12, max_epochs=-1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              log_every_n_steps=5, limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False,
              callbacks=[guard], default_root_dir=tmp_path).fit(model, dm)
    if every is None:   # one read (one transfer) at each log step, none in between
        assert guard.reads == {5: ["tolist"], 10: ["tolist"]}, guard.reads
    else:               # every step: the loss before backward, then the step's checks (the old behaviour)
        assert guard.reads == {s: ["__bool__", "tolist"] for s in range(1, 13)}, guard.reads
    assert [s for s, _ in guard.history][-1] == 12          # the last steps were read at the end of training


def test_a_checkpoint_taken_between_reads_holds_every_finished_step(tmp_path, one_thread):
    class SaveAt7(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 7:
                trainer.save_checkpoint(tmp_path / f"at7-{id(self)}.ckpt")

    histories = []
    for every in (1, None):
        L.seed_everything(0)
        model, dm = BLOWUPS["mrp_literal_lr1e8"]()
        model.lr = 1.0
        saver = SaveAt7()
        fit(model, dm, 9, [DivergenceGuard(check_every_n_steps=every), saver], tmp_path)
        histories.append(torch.load(tmp_path / f"at7-{id(saver)}.ckpt", weights_only=False)["callbacks"])
    assert histories[0] == histories[1]
    assert [s for s, _ in histories[1]["DivergenceGuard"]["history"]][-1] == 7


def test_another_error_after_a_divergence_names_it(tmp_path, one_thread):
    # NaN weights can break a method's own code before the next read: the divergence is noted under the error
    class Broken(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 5:
                raise RuntimeError("the method's own code failed")

    L.seed_everything(0)
    model, dm = BLOWUPS["mrp_literal_lr1e8"]()
    with pytest.raises(RuntimeError, match="own code") as err:
        fit(model, dm, 50, [DivergenceGuard(), Broken()], tmp_path)
    notes = getattr(err.value, "__notes__", [])
    assert len(notes) == 1 and "before this error, training diverged at global step 1 " in notes[0], notes


class _FakeStrategy:
    def __init__(self, other_rank_diverges_at):
        self.at, self.calls = other_rank_diverges_at, []

    def reduce(self, flags, reduce_op):
        assert reduce_op == "sum"
        self.calls.append(flags.shape)
        other = torch.tensor([[float(s == self.at), 0.0] for s in self.steps], dtype=flags.dtype)
        return flags + other


class _FakeTrainer:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_several_processes_reduce_once_per_read_and_stop_where_any_diverged():
    module = TeacherStudentMRP(m=2, backend="torch").attach(MultiViewDataModule(k=4, d=32, P=8, s=1.0, seed=1))
    strategy = _FakeStrategy(other_rank_diverges_at=5)
    trainer = _FakeTrainer(world_size=2, strategy=strategy, global_step=0, current_epoch=0,
                                    log_every_n_steps=3, checkpoint_callback=None, checkpoint_callbacks=[],
                                    callbacks=[], callback_metrics={}, lightning_module=module)
    guard = DivergenceGuard()
    guard.on_train_start(trainer, module)
    with pytest.raises(DivergenceError) as err:
        for step in range(1, 10):
            strategy.steps = range(step - 2, step + 1)
            loss = torch.tensor(1.0 / step)
            guard.on_before_backward(trainer, module, loss)
            trainer.global_step = step
            guard.on_train_batch_end(trainer, module, {"loss": loss}, None, 0)
    assert strategy.calls == [(3, 2), (3, 2)]                    # read at steps 3 and 6 only, one reduction each
    assert "global step 5 " in str(err.value) and "another process diverged" in str(err.value)
    assert trainer.global_step == 6 and [s for s, _ in guard.history] == [0, 1, 2, 3, 4]


def test_interval_is_checked(tmp_path, capsys):
    from featlearn.errors import ConfigError

    with pytest.raises(ConfigError, match="divergence.check_every_n_steps: must be an integer >= 1 or null, got 0"):
        DivergenceGuard(check_every_n_steps=0)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/mrp/teacher_student.yaml", "--divergence.check_every_n_steps", "0",
              "--trainer.default_root_dir", str(tmp_path)])
    assert "divergence.check_every_n_steps" in capsys.readouterr().err + str(stop.value.code)


class _LogsNaNAt(NonContrastiveModule):
    """Logs one extra metric each step, NaN at global step ``bad`` only (finite before and after)."""

    def __init__(self, bad: int, **kwargs):
        super().__init__(**kwargs)
        self.bad = bad

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        value = torch.tensor(float("nan") if self.global_step + 1 == self.bad else 1.0)
        self.log("probe", value, on_step=True, on_epoch=False)
        return loss


@pytest.mark.parametrize("every", [1, 7])
def test_a_metric_that_was_nan_at_one_step_is_named_at_that_step(tmp_path, every, one_thread):
    # the guard keeps references to each step's logged values and reads them every `every` steps: a value
    # Lightning overwrote in place before the read would hide the NaN, or move it to a later step
    L.seed_everything(0)
    model = _LogsNaNAt(bad=4, width=2, gradient="population", backend="torch")
    dm = TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=2)
    with pytest.raises(DivergenceError, match=r"global step 4 \(epoch 0\): metric 'probe' is nan"):
        fit(model, dm, 20, [DivergenceGuard(check_every_n_steps=every)], tmp_path)
    assert model.trainer.global_step == (4 if every == 1 else 7)
