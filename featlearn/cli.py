"""The ``featlearn`` / ``lightning`` command: a LightningCLI over every method and DataModule.

Usage:
    lightning fit --config configs/mrp/teacher_student.yaml
    lightning fit --config configs/mrp/teacher_student.yaml --print_config   # every default
    lightning validate --config ... --ckpt_path path/to/last.ckpt

Every run gets a :class:`~featlearn.callbacks.DivergenceGuard`, a
:class:`~featlearn.callbacks.HeatmapLogger` (``--heatmap.every_n_steps``) and a ModelCheckpoint that
keeps ``last.ckpt`` (``--checkpoint.*``); TensorBoard is the default logger. A config value outside
what a method allows is refused before training with a message naming the field.
"""
import sys

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from featlearn.callbacks import DivergenceGuard, HeatmapLogger
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError, DivergenceError
from featlearn.lightning_modules.base import FeatureLearningModule


class FeatlearnCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(DivergenceGuard, "divergence")
        parser.add_lightning_class_args(HeatmapLogger, "heatmap")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.every_n_train_steps": 100,
                             "checkpoint.save_top_k": 0, "checkpoint.monitor": None})

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:  # jsonargparse wraps a ConfigError raised by a class in its own ValueError
            self.parser.error(_config_message(err))


def _config_message(err: ValueError) -> str:
    """The ConfigError lines (``field: must be ...``) of a possibly wrapped error, else the whole text."""
    lines = [line.strip(" -") for line in str(err).splitlines() if ": must be " in line]
    return "\n".join(dict.fromkeys(lines)) or str(err)


def main(args=None) -> None:
    try:
        FeatlearnCLI(FeatureLearningModule, SyntheticDataModule, subclass_mode_model=True,
                     subclass_mode_data=True, seed_everything_default=0, args=args,
                     auto_configure_optimizers=False)
    except ConfigError as err:
        sys.exit(f"error: {err}")
    except DivergenceError as err:
        sys.exit(f"diverged: {err}")


if __name__ == "__main__":
    main()
