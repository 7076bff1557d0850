"""The ``featlearn`` / ``lightning`` command: a LightningCLI over every method and DataModule.

Usage:
    lightning fit --config configs/mrp/teacher_student.yaml
    lightning fit --config configs/mrp/teacher_student.yaml --print_config   # every default
    lightning validate --config ... --ckpt_path path/to/last.ckpt
    featlearn bench op|step ...                                            # featlearn/bench
    featlearn profile --config configs/mrp/teacher_student.yaml --steps 10   # featlearn/profile.py
    featlearn gpu compile|check|wheels ...                                   # featlearn/gpu

Every run gets a :class:`~featlearn.callbacks.DivergenceGuard`, a
:class:`~featlearn.callbacks.HeatmapLogger` (``--heatmap.every_n_steps``) and a
:class:`~featlearn.callbacks.FinalCheckpoint` that keeps ``last.ckpt``, the final state (``--checkpoint.*``); TensorBoard is the default logger. A config value outside
what a method allows is refused before training with a message naming the field.
"""
import argparse
import ast
import difflib
import math
import re
import sys
from typing import Literal

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning.pytorch.callbacks import ProgressBar

from featlearn.callbacks import DivergenceGuard, FinalCheckpoint, HeatmapLogger, StepProgressBar
from featlearn.checkpoints import check_fits, class_path, read_checkpoint
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError, DivergenceError
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.quiet import quiet_known_noise
from featlearn.validation import (NonNegativeInt, PositiveInt, accepts, check_yaml_files, describe, int_at_least,
                                  number_type)

GrowthFactor = number_type("GrowthFactor", float, 1, math.inf, True, True, "a finite factor > 1")

# Trainer and callback fields whose types (from Lightning) admit values that fail only once training runs
# (a ZeroDivisionError at the first logged step) or deep inside the Trainer; checked after parsing.
RUN_FIELDS = {
    "trainer.max_steps": (int_at_least(-1), "-1: no limit"),
    "trainer.min_steps": (NonNegativeInt | None, ""),
    "trainer.max_epochs": (int_at_least(-1) | None, "-1: no limit"),
    "trainer.min_epochs": (NonNegativeInt | None, ""),
    "trainer.log_every_n_steps": (PositiveInt | None, ""),
    "trainer.check_val_every_n_epoch": (PositiveInt | None, ""),
    "trainer.num_nodes": (PositiveInt, ""),
    "trainer.num_sanity_val_steps": (int_at_least(-1) | None, ""),
    "trainer.accumulate_grad_batches": (Literal[1], "sample streams follow the optimizer step; raise "
                                                    "data.batch_size instead"),
    "checkpoint.every_n_train_steps": (NonNegativeInt | None, "0 or null: no periodic saves"),
    "checkpoint.every_n_epochs": (NonNegativeInt | None, ""),
    "checkpoint.save_top_k": (int_at_least(-1), ""),
    "heatmap.every_n_steps": (PositiveInt, ""),
    "divergence.window": (PositiveInt, ""),
    "divergence.loss_growth": (GrowthFactor | None, ""),
    "divergence.weight_growth": (GrowthFactor | None, ""),
    "divergence.check_every_n_steps": (PositiveInt | None, "null: trainer.log_every_n_steps"),
}
# names Lightning resolves itself from the run's checkpoint callback
_CKPT_ALIASES = ("last", "best", "hpc")

OTHER_COMMANDS = """featlearn's own commands (also `featlearn <command> --help`):
  featlearn bench op|step|plot ...   fused ops and training steps vs eager and torch.compile
  featlearn profile --config CFG     a torch.profiler trace of a few training steps
  featlearn gpu compile|check|wheels GPU readiness: sm_90 builds offline, the prepared GPU check
experiments: python -m featlearn.experiments.<mrp|contrastive|noncontrastive|vit|two_layer|universality|sweep> --help"""


class _RawEpilog(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's lines (the list of featlearn's other commands) as written."""


class FeatlearnCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(DivergenceGuard, "divergence")
        parser.add_lightning_class_args(HeatmapLogger, "heatmap")
        parser.add_lightning_class_args(FinalCheckpoint, "checkpoint")
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
        progress bar is off or the config brings its own."""
        own = [c for c in (config.get("callbacks") or []) if isinstance(c, ProgressBar)]
        if config.get("enable_progress_bar", True) is not False and not own:
            callbacks = [*callbacks, StepProgressBar()]
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
        if self.subcommand is None or self.datamodule is None:
            return
        self.datamodule.check_devices(self.trainer.world_size)
        self.model.attach(self.datamodule)
        if self._ckpt is not None:
            path, ckpt = self._ckpt
            self._ckpt = None
            check_fits("ckpt_path", path, ckpt, self.model)


class _ShortErrorParser(LightningArgumentParser):
    """Print a parse error as one line, ``error: <field>: <what is wrong>``, without the usage text."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # an inner parser: its caller reports the error
            return super().error(message, ex)
        _refuse(short_message(message) + self._suggestion(message))

    def _suggestion(self, message: str) -> str:
        """``; did you mean --trainer.max_steps?`` for an option or config key the parser does not know."""
        unknown = (re.search(r"unrecognized arguments: -*([\w.]+)", message, re.IGNORECASE)
                   or re.search(r"does not accept option '([\w.]+)'", message))
        if unknown is None:
            return ""
        known = [o[2:] for p in self._parsers() for o in p._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(unknown.group(1), known, n=1, cutoff=0.75)
        return f"; did you mean --{close[0]}?" if close else ""

    def _parsers(self):
        """This parser and its subcommands' (``fit``, ``validate``, ...)."""
        found = [self]
        for action in self._actions:
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):
                found += [p for p in choices.values() if isinstance(p, argparse.ArgumentParser)]
        return found


def _refuse(line: str):
    sys.stderr.write(f"error: {line}\n")
    raise SystemExit(2)


def short_message(message: str) -> str:
    """``field: reason`` from a jsonargparse error, which nests one ``Parser key "name":`` block per class
    level (``model`` > ``m``) around the reason (``Not of type IntAtLeast1: must be ..., got 0``)."""
    keys, reason = [], None
    for raw in message.splitlines():
        line = raw.strip().lstrip("-").strip()
        key = re.match(r'Parser key "([^"]+)":\s*(.*)$', line)
        if key:
            keys.append(key.group(1))
            line = key.group(2)
        if not line or line.startswith(("Does not validate against", "Subtypes:", "Errors:", "Problem with given",
                                        "Given value", "Expected a <class 'NoneType'>")):
            continue
        reason = line
        break
    if not keys:
        return message.strip().splitlines()[0] if message.strip() else "invalid arguments"
    field = ".".join(k for k in keys if k != "init_args").replace(".init_args.", ".")
    reason = reason or "invalid value"
    reason = re.sub(r"^Not of type \w+: ", "", reason)
    literal = re.match(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$", reason)
    if literal:
        try:
            allowed = describe(Literal[ast.literal_eval(f"({literal.group(1)},)")])
        except (ValueError, SyntaxError):
            allowed = f"one of ({literal.group(1)})"
        reason = f"must be {allowed}, got {literal.group(2)!r}"
    plain = re.match(r"Expected a <class '(\w+)'>(?:\. Got value: (.*))?$", reason)
    given = re.search(r"^\s*Given value: (.*)$", message, re.MULTILINE)
    given = plain.group(2) if plain and plain.group(2) is not None else given.group(1) if given else None
    if plain and field in RUN_FIELDS:  # a Lightning annotation (float | None): say what featlearn allows
        allowed, note = RUN_FIELDS[field]
        reason = f"must be {describe(allowed)}" + (f" ({note})" if note else "") + f", got {given!r}"
    elif plain and plain.group(1) == "float" and given is not None and _not_finite(given):
        reason = f"must be a finite number, got {given!r}"   # nan and inf are floats to Python, not to us
    elif plain:
        reason = f"must be of type {plain.group(1)}, got {given!r}"
    return f"{field}: {reason}"


def _not_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _check_devices(value) -> None:
    """``trainer.devices``: a count >= 1, -1 (every device), 'auto', or device ids (a list, or '0,1')."""
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    ids = value if isinstance(value, (list, tuple)) else None
    if isinstance(value, str) and "," in value:
        ids = [int(p) if p.strip().isdigit() else -1 for p in value.split(",") if p.strip()]
    ok = (value == "auto" or value == -1 or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
          or (ids is not None and len(ids) > 0 and all(isinstance(i, int) and i >= 0 for i in ids)))
    if not ok:
        raise ConfigError("trainer.devices", "a device count >= 1, -1 (all), 'auto' or a list of device ids",
                          value)


def _config_error(err: Exception) -> ConfigError | None:
    """The ConfigError behind an error raised while instantiating (jsonargparse re-raises what a class
    raises as its own ValueError, sometimes keeping only the text)."""
    seen = err
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__ or seen.__context__
    for line in str(err).splitlines():
        field, sep, rest = line.strip(" -").partition(": must be ")
        if sep and re.fullmatch(r"[\w.]+", field):
            allowed, _, got = rest.rpartition(", got ")
            return ConfigError(field, allowed or rest, got)
    return None


def _raised_by_trainer(err: BaseException) -> bool:
    """Whether Lightning's Trainer set-up (accelerator, strategy, precision connectors) raised ``err``."""
    tb = err.__traceback__
    while tb is not None:
        if "lightning/pytorch/trainer/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


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
