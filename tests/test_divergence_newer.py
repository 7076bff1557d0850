"""Divergence on the newer methods (issue 22, section 3): ViT growth from zero-initialised weights, a guard that
stops before the attention figures read diverged weights, a warning when a projected method fails to learn, and
stop messages that name the module's own step-size fields."""
import inspect
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from featlearn.callbacks import DivergenceGuard, FinalCheckpoint
from featlearn.datamodules.global_local_patches import GlobalLocalPatchDataModule
from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
from featlearn.errors import DivergenceError
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.lightning_modules.two_layer import TwoLayerNetwork
from featlearn.lightning_modules.universality import LinearContrastive
from featlearn.lightning_modules.vit_cl import ViTCL
from featlearn.lightning_modules.vit_mae import ViTMAE
from tiny_sizes import VIT

import featlearn.lightning_modules as modules_package


def vit(kind, lr):
    """configs/vit/mae.yaml or cl.yaml at tests/tiny_sizes.py's VIT sizes."""
    data = dict(P=256, K=4, kappa_c=0.875, kappa_s=0.5, layout="random", basis="canonical", mode="online", seed=0)
    if kind == "mae":
        return ViTMAE(gamma=0.75, lr=lr, path="structured"), GlobalLocalPatchDataModule(**{**data, **VIT})
    return (ViTCL(gamma0=0.5, lr=lr if lr is not None else 5000.0),
            GlobalLocalPatchDataModule(**{**data, **VIT, "K": 8, "d": 512}))


def fit(model, dm, steps, root, callbacks=(), logger=False, ckpt_path=None):
    L.seed_everything(0)
    trainer = L.Trainer(max_steps=steps, max_epochs=-1, logger=logger, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=10, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[DivergenceGuard(), *callbacks], default_root_dir=root,
                        enable_checkpointing=any(isinstance(c, FinalCheckpoint) for c in callbacks))
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("kind,lr", [("mae", 1e6), ("cl", 1e9)])
def test_vit_weights_that_jump_from_zero_are_stopped(tmp_path, kind, lr, one_thread):
    # these ran to the end with |Q| ~ 5e5 in a saturated softmax: the weights start at 0, so no growth
    # factor over the window saw them; they are measured against the method's scale instead
    with pytest.raises(DivergenceError) as err:
        fit(*vit(kind, lr), 40, tmp_path)
    message = str(err.value)
    assert "global step 1 " in message and "weight norm" in message and "scale" in message, message
    assert "--model.init_args.lr" in message


@pytest.mark.parametrize("kind", ["mae", "cl"])
def test_vit_default_runs_are_not_stopped(tmp_path, kind, one_thread):
    model, dm = vit(kind, None)
    fit(model, dm, 60, tmp_path)
    assert model.trainer.global_step == 60


def checkpointing(root, every):
    return FinalCheckpoint(dirpath=root, save_last=True, every_n_train_steps=every, save_top_k=0, monitor=None)


@pytest.mark.parametrize("kind", ["mae", "cl"])
def test_vit_lr_1e30_stops_with_the_guard_before_the_figures(tmp_path, kind, one_thread):
    # was: ValueError "The histogram is empty" in log_attention_figures at step 9, and checkpoints of
    # overflowing weights; now the guard speaks first and the kept checkpoint predates the damage
    with pytest.raises(DivergenceError, match="global step 1 .*weight norm"):
        fit(*vit(kind, 1e30), 30, tmp_path / "fresh", [checkpointing(tmp_path / "fresh", 1)],
            TensorBoardLogger(tmp_path / "logs"))
    assert not list((tmp_path / "fresh").glob("*.ckpt"))  # nothing saved after the damage
    model, dm = vit(kind, None)
    fit(model, dm, 10, tmp_path / "a", [checkpointing(tmp_path, 5)], TensorBoardLogger(tmp_path / "logs"))
    model, dm = vit(kind, 1e30)
    with pytest.raises(DivergenceError) as err:
        fit(model, dm, 30, tmp_path / "b", [checkpointing(tmp_path, 1)], TensorBoardLogger(tmp_path / "logs"),
            ckpt_path=tmp_path / "last.ckpt")
    assert "global step 11 " in str(err.value) and "weight norm" in str(err.value), str(err.value)
    kept = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert kept["global_step"] == 10
    assert all(torch.isfinite(v).all() for v in kept["state_dict"].values())
    model, dm = vit(kind, None)   # resumable at the default step size
    fit(model, dm, 15, tmp_path / "c", [checkpointing(tmp_path, 5)], ckpt_path=tmp_path / "last.ckpt")
    assert model.trainer.global_step == 15


def universality(lr):
    data = dict(T=4, s=5, r=10, u=10, dictionary="haar", label_noise=0.25, batch_size=512, num_val=16, num_test=256)
    return LinearContrastive(lr=lr, probe_repeats=1), HiddenRepresentationDataModule(**data)


def test_universality_warns_when_a_large_step_stalls_it(tmp_path, one_thread):
    # ||W||_F is projected back every step: lr 1e6 cannot blow up, it ends near 0.1 against ~0.02
    for lr, stalls in ((1e6, True), (0.5, False)):
        model, dm = universality(lr)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(model, dm, 300, tmp_path)
        notes = [str(w.message) for w in caught if "did not learn" in str(w.message)]
        assert bool(notes) == stalls, (lr, notes)
        if stalls:
            assert "closed-form optimum" in notes[0] and "--model.init_args.lr" in notes[0]


def test_two_layer_message_names_its_own_step_size_fields(tmp_path):
    # a two-layer run at lr1_mult 1e6 was told to change --model.init_args.lr, which that module lacks
    from featlearn.callbacks.divergence import _checkpoint_note

    class Trainer:
        checkpoint_callback, lightning_module = None, TwoLayerNetwork(width=8)

    message = _checkpoint_note(Trainer())
    assert "--model.init_args.lr1_mult" in message and "--model.init_args.lr3_mult" in message, message
    assert "--model.init_args.lr)" not in message and "--model.init_args.lr " not in message


def module_classes():
    """Every method class (a LightningModule with a build) defined in featlearn.lightning_modules."""
    import importlib
    import pkgutil
    found = {}
    for info in pkgutil.iter_modules(modules_package.__path__):
        module = importlib.import_module(f"{modules_package.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            # abstract bases (no build of their own) are never configured; every method class is
            if (issubclass(cls, FeatureLearningModule) and cls.__module__ == module.__name__
                    and cls.build is not FeatureLearningModule.build):
                found[cls.__qualname__] = cls
    return found


def init_arguments(cls) -> set[str]:
    """The named ``__init__`` arguments of ``cls``, following ``**kwargs`` to the parents."""
    names = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass in (FeatureLearningModule, L.LightningModule):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


@pytest.mark.parametrize("name,cls", list(module_classes().items()))
def test_step_size_fields_are_init_arguments(name, cls):
    fields = getattr(cls, "step_size_fields", ("lr",))  # what the guard names
    assert fields and set(fields) <= init_arguments(cls), (name, fields, sorted(init_arguments(cls)))
