"""The ``featlearn`` / ``lightning`` command: a LightningCLI over every method and DataModule.

Usage:
    lightning fit --config configs/mrp/teacher_student.yaml
    lightning fit --config configs/mrp/teacher_student.yaml --print_config   # every default
    lightning validate --config ... --ckpt_path path/to/last.ckpt
    featlearn bench op|step ...                                            # featlearn/bench
    featlearn profile --config configs/mrp/teacher_student.yaml --steps 10   # featlearn/profile.py
    featlearn gpu compile|check|wheels ...                                   # featlearn/gpu

Every run gets a :class:`~featlearn.callbacks.DivergenceGuard`, a
:class:`~featlearn.callbacks.HeatmapLogger` (``--heatmap.every_n_steps``), a
:class:`~featlearn.callbacks.RepresentationSpectrum` (``--spectrum.every_n_steps``; 0: off) and a
:class:`~featlearn.callbacks.FinalCheckpoint` that keeps ``last.ckpt``, the final state (``--checkpoint.*``);
TensorBoard is the default logger. ``--seeds '[0, 1, 2]'`` trains several seeds in one run
(:mod:`featlearn.lightning_modules.seeds`). A config value outside
what a method allows is refused before training with a message naming the field.
"""
import argparse
import contextlib
import sys

import yaml

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI

from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.fabric.utilities.seed import seed_everything

from featlearn.callbacks import DivergenceGuard, FinalCheckpoint, HeatmapLogger, RepresentationSpectrum, StepProgressBar
from featlearn.checkpoints import check_fits, class_path, read_checkpoint
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.datamodules.seeds import SeedStackDataModule
from featlearn.cli_errors import (RUN_FIELDS, _ShortErrorParser, _check_devices, _config_error, _raised_by_trainer,
                                  _refuse)
from featlearn.errors import ConfigError, DivergenceError
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.lightning_modules.seeds import SeedStack
from featlearn.quiet import quiet_known_noise
from featlearn.validation import accepts, check_yaml_files, describe

# names Lightning resolves itself from the run's checkpoint callback
_CKPT_ALIASES = ("last", "best", "hpc")

OTHER_COMMANDS = """featlearn's own commands (also `featlearn <command> --help`):
  featlearn bench op|step|plot ...   fused ops and training steps vs eager and torch.compile
  featlearn profile --config CFG     a torch.profiler trace of a few training steps
  featlearn gpu compile|check|wheels GPU readiness: sm_90 builds offline, the prepared GPU check
experiments: python -m featlearn.experiments.<mrp|contrastive|noncontrastive|vit|two_layer|universality|sweep> --help"""


class NoOpProfiler(PassThroughProfiler):
    """Lightning's default profiler (which records nothing), without its cost: Lightning enters ``profile()``
    around every hook of every callback, ~120 times a step in a CLI run, and the default builds a generator
    context each time (~0.1 ms of a 1.4 ms population step). A run that sets ``--trainer.profiler`` keeps its own."""

    _NOTHING = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:
        return self._NOTHING


class _RawEpilog(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's lines (the list of featlearn's other commands) as written."""


class FeatlearnCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(DivergenceGuard, "divergence")
        parser.add_lightning_class_args(HeatmapLogger, "heatmap")
        parser.add_lightning_class_args(RepresentationSpectrum, "spectrum")
        parser.add_lightning_class_args(FinalCheckpoint, "checkpoint")
        parser.add_argument("--seeds", type=list[int] | None, default=None,
                            help="train these seeds together in one run, each as --seed_everything s "
                                 "--data.init_args.seed s (and the model's seed) would alone: one TensorBoard run "
                                 "and checkpoint per seed under <log_dir>/seed_<s> (featlearn.lightning_modules.seeds)")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.every_n_train_steps": 100,
                             "checkpoint.save_top_k": 0, "checkpoint.monitor": None})

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("parser_class", _ShortErrorParser)
        # no prefix matching: `--trainer.max_step 5` is refused (with a suggestion), not read as max_steps
        kwargs.setdefault("parser_kwargs", {"allow_abbrev": False, "epilog": OTHER_COMMANDS,
                                            "formatter_class": _RawEpilog})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # ./config.yaml of logger-less runs
        check_yaml_files(sys.argv[1:] if kwargs.get("args") is None else kwargs["args"])
        quiet_known_noise()
        super().__init__(*args, **kwargs)

    def before_fit(self) -> None:
        if self.trainer.is_global_zero:
            where = self.trainer.log_dir
            print(f"featlearn: logs in {where} (tensorboard --logdir {where})" if where else
                  "featlearn: no logger (trainer.logger is false): metrics are not written", flush=True)

    def after_fit(self) -> None:
        final = next((c for c in self.trainer.callbacks if isinstance(c, FinalCheckpoint)), None)
        if self.trainer.is_global_zero and final is not None and final.last_model_path:
            print(f"featlearn: final checkpoint {final.last_model_path} (resume or evaluate with --ckpt_path)",
                  flush=True)

    def _instantiate_trainer(self, config: dict, callbacks: list):
        """Show training progress in steps against ``max_steps`` (:class:`StepProgressBar`) unless the
        progress bar is off or the config brings its own; profile nothing, cheaply (:class:`NoOpProfiler`),
        unless the config sets a profiler."""
        own = [c for c in (config.get("callbacks") or []) if isinstance(c, ProgressBar)]
        if config.get("enable_progress_bar", True) is not False and not own:
            callbacks = [*callbacks, StepProgressBar()]
        if config.get("profiler") is None:
            config = {**config, "profiler": NoOpProfiler()}
        return super()._instantiate_trainer(config, callbacks)

    def _parse_ckpt_path(self) -> None:
        """Keep the config as given. LightningCLI would overwrite the model's arguments with the
        hyperparameters stored in ``--ckpt_path``, so resuming with ``--model.init_args.lr SMALLER`` after
        a blow-up would silently train at the old learning rate again.

        Instead the file is checked here, before anything is built: it must exist, be readable and come
        from the config's method; its sizes are compared with the built model in
        :meth:`after_instantiate_classes`."""
        self._ckpt = None
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not path or str(path) in _CKPT_ALIASES or str(path).startswith("registry"):
            return
        ckpt = read_checkpoint("ckpt_path", path)
        wanted, found = self.config[subcommand].get("model.class_path"), class_path(ckpt)
        if wanted and found and found != wanted:
            raise ConfigError("ckpt_path", f"a checkpoint of the config's {wanted.rsplit('.', 1)[-1]} (this file "
                                           f"was written by {found.rsplit('.', 1)[-1]})", str(path))
        self._ckpt = (path, {"state_dict": ckpt["state_dict"]})

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        for field, (allowed, note) in RUN_FIELDS.items():
            if field in config and not accepts(allowed, config[field]):
                raise ConfigError(field, describe(allowed) + (f" ({note})" if note else ""), config[field])
        if "trainer.devices" in config:
            _check_devices(config["trainer.devices"])
        _results_not_placeholders(config.get("trainer.logger"))
        seeds, seed = config.get("seeds"), config.get("seed_everything")
        self._seed_texts = {key: value for key, value in config.items() if seeded_text(key, value, 0) != value}
        first = seeds[0] if seeds else seed if isinstance(seed, int) and not isinstance(seed, bool) else None
        for key, text in self._seed_texts.items():  # the run's seed; with --seeds the first (the stack rebuilds each)
            if first is None:
                raise ConfigError(key, "a text whose {seed} a run can fill: give --seed_everything an integer or "
                                       "--seeds", text)
            config[key] = seeded_text(key, text, first)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:  # jsonargparse wraps what a class raises in its own error
            config_error = _config_error(err)
            if config_error is None and _raised_by_trainer(err):  # e.g. fsdp without a GPU
                config_error = ConfigError("trainer", "a combination of settings the Trainer accepts",
                                           str(err).splitlines()[0])
            if config_error is None:
                raise
            raise config_error from None
        except MisconfigurationException as err:  # the Trainer's own checks, for fields not in RUN_FIELDS
            raise ConfigError("trainer", "a setting the Trainer accepts", str(err)) from None

    def after_instantiate_classes(self) -> None:
        """Build the parameters now, not in ``setup`` once fitting has started, so that a refusal that
        needs the data's sizes (a checkpoint of another size, a pretrained encoder of another width)
        comes before any work; ``attach`` builds once, so ``setup`` then finds the model built."""
        seeds = self._config().get("seeds")
        if self.datamodule is None or (self.subcommand is None and seeds is None):  # the caller fits it: built in setup
            return
        self.datamodule.check_devices(self.trainer.world_size)
        self.model.attach(self.datamodule)
        if seeds is not None:
            self.model, self.datamodule = self._stack_seeds(seeds)
        if self._ckpt is not None:
            path, ckpt = self._ckpt
            self._ckpt = None
            check_fits("ckpt_path", path, ckpt, self.model)

    def _config(self):
        return self.config[self.subcommand] if self.subcommand else self.config

    def _stack_seeds(self, seeds: list[int]):
        """The config's method and data once per seed, each built as a run of that seed alone would be, as
        a :class:`~featlearn.lightning_modules.seeds.SeedStack` and its DataModule."""
        if not seeds or len(set(seeds)) != len(seeds) or not all(0 <= s < 2 ** 32 for s in seeds):
            raise ConfigError("seeds", "a non-empty list of distinct seeds in [0, 2^32)", seeds)
        if self.subcommand not in ("fit", None):  # None: built to be fitted by the caller (the experiments)
            raise ConfigError("seeds", f"given to `fit` only (for `{self.subcommand}`, give one seed's own "
                                       "checkpoint, <log_dir>/seed_<s>/last.ckpt)", seeds)
        config = self._config()
        _check_seed_settings(self.trainer, config)
        parser = self._parser(self.subcommand) if self.subcommand else self.parser
        models, datas, dump = [], [], self.config_dump
        for seed in seeds:
            seeded = config.clone()
            seeded["seed_everything"] = seed
            for key in ("data.init_args.seed", "model.init_args.seed"):
                if key in seeded:
                    seeded[key] = seed
            for key, text in self._seed_texts.items():  # "{seed}" in a method's or data's text: this seed's
                seeded[key] = seeded_text(key, text, seed)
            # the hyperparameters a module saves are read from this dump (LightningCLI's instantiator)
            self.config_dump = yaml.safe_load(parser.dump(seeded, skip_link_targets=False, skip_none=False))
            seed_everything(seed, verbose=False)
            built = parser.instantiate_classes(seeded)
            built.data.check_devices(self.trainer.world_size)
            models.append(built.model.attach(built.data))
            datas.append(built.data)
        self.config_dump = dump
        for key, text in self._seed_texts.items():  # the run's saved config.yaml keeps the template
            config[key] = text
        return SeedStack(models, seeds), SeedStackDataModule(datas, seeds)


def seeded_text(key: str, value, seed: int):
    """``value`` with ``{seed}`` replaced by ``seed`` where it is a text of the method's or the data's arguments
    (``model.*``, ``data.*``: a per-seed checkpoint to start from); any other value as it is.

    Example:
        >>> seeded_text("model.init_args.reference", "runs/u/seed_{seed}/last.ckpt", 3)
        'runs/u/seed_3/last.ckpt'
        >>> seeded_text("trainer.default_root_dir", "runs/{seed}", 3)
        'runs/{seed}'
    """
    if isinstance(value, str) and "{seed}" in value and key.startswith(("model.", "data.")):
        return value.replace("{seed}", str(seed))
    return value


def _check_seed_settings(trainer, config) -> None:
    """Refuse, with several seeds in one run, the settings that would couple the seeds (one gradient norm, one
    loss scale, one monitored metric) or that cannot hold their stacked weights (sharded or spawned processes)."""
    strategy = trainer.strategy
    if not isinstance(strategy, SingleDeviceStrategy) and not (
            type(strategy) is DDPStrategy and getattr(strategy, "_start_method", "popen") == "popen"):
        raise ConfigError("trainer.strategy", "auto or ddp with --seeds (each process holds every seed)",
                          type(strategy).__name__)
    if trainer.gradient_clip_val:
        raise ConfigError("trainer.gradient_clip_val", "null with --seeds (one norm over all seeds would couple them)",
                          trainer.gradient_clip_val)
    if str(trainer.precision) == "16-mixed":
        raise ConfigError("trainer.precision", "not 16-mixed with --seeds (one loss scale would skip every seed's "
                                               "step for one seed's overflow)", trainer.precision)
    if config.get("checkpoint.monitor") is not None:
        raise ConfigError("checkpoint.monitor", "null with --seeds (each seed logs to its own run)",
                          config.get("checkpoint.monitor"))


def _results_not_placeholders(logger) -> None:
    """TensorBoard's HPARAMS tab shows each run's ``final_metrics`` (logged at the end of training as
    ``hp/<name>``), so the logger's placeholder ``hp_metric = -1`` is always off."""
    for entry in logger if isinstance(logger, list) else [logger]:
        init_args = getattr(entry, "init_args", None)
        if str(getattr(entry, "class_path", "")).endswith("TensorBoardLogger") and init_args is not None:
            init_args["default_hp_metric"] = False


def make_cli(args=None, run: bool = True) -> FeatlearnCLI:
    """The featlearn CLI over every method and DataModule (``run=False``: build trainer, model and data
    without running a subcommand, as the experiments do)."""
    return FeatlearnCLI(FeatureLearningModule, SyntheticDataModule, subclass_mode_model=True,
                        subclass_mode_data=True, seed_everything_default=0, args=args, run=run,
                        auto_configure_optimizers=False)


def main(args=None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["bench"]:  # the benchmark harness has its own options; LightningCLI never sees them
        from featlearn.bench.cli import main as bench_main

        bench_main(argv[1:])
        return
    if argv[:1] == ["gpu"]:  # GPU readiness: offline sm_90 compile, the prepared GPU check, wheels (featlearn/gpu)
        from featlearn.gpu.cli import main as gpu_main

        gpu_main(argv[1:])
        return
    if argv[:1] == ["profile"]:  # a torch.profiler trace of a few steps of a config (featlearn/profile.py)
        from featlearn.profile import main as profile_main

        profile_main(argv[1:])
        return
    try:
        make_cli(args)
        _close_process_group()
    except ConfigError as err:
        _refuse(str(err))
    except DivergenceError as err:
        sys.exit(f"diverged: {err}")
    except RuntimeError as err:
        if not getattr(err, "featlearn_message", None):
            raise
        sys.exit(f"error: {err.featlearn_message}")  # a lost rank: the line says it all, not gloo's traceback


def _close_process_group() -> None:
    """Every rank meets at a barrier and destroys the process group before the interpreter exits: a gloo
    group left to the exit's destructors can abort a rank ("terminate called without an active exception",
    exit code -6) while its peer is still closing its connections."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
