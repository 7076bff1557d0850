"""Reading checkpoint files given in a config (``--ckpt_path``, ``model.pretrained``), with a refusal that
names the field, the file and what is wrong, instead of a traceback from deep inside a load.

Example:
    >>> read_checkpoint("ckpt_path", "/no/such.ckpt")
    Traceback (most recent call last):
    featlearn.errors.ConfigError: ckpt_path: must be an existing checkpoint file, got '/no/such.ckpt'
"""
from pathlib import Path

import torch

from featlearn.errors import ConfigError


def read_checkpoint(field: str, path) -> dict:
    """The checkpoint at ``path`` (on the CPU), refused with a :class:`ConfigError` naming ``field`` when
    the file is missing, cannot be read (truncated, corrupt) or is not a Lightning checkpoint.

    Loads with ``weights_only=True``, as Lightning's CLI itself does before a run, so nothing Lightning
    would accept is refused here and no code inside the file runs.
    """
    if not Path(path).is_file():
        raise ConfigError(field, "an existing checkpoint file", str(path))
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError... by the damage found
        with open(path, "rb") as f:
            zipped = f.read(2) == b"PK"  # torch.save writes a zip archive
        words = str(err).strip().split(". ")[0].splitlines()[0][:120] if str(err).strip() else type(err).__name__
        what = f"truncated or damaged: {words}" if zipped else "not a PyTorch checkpoint: corrupt, or another kind of file"
        raise ConfigError(field, f"a readable checkpoint (this file is {what})", str(path)) from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ConfigError(field, "a Lightning checkpoint (this file holds no state_dict)", str(path))
    return ckpt


def class_path(ckpt: dict) -> str | None:
    """The import path of the LightningModule that wrote the checkpoint, when the CLI recorded it."""
    return (ckpt.get("hyper_parameters") or {}).get("_class_path")


def check_fits(field: str, path, ckpt: dict, model: torch.nn.Module) -> None:
    """Refuse a checkpoint whose parameters are not exactly those of ``model`` (built for the config's
    data): other names (another method) or other shapes (another size)."""
    expected = model.state_dict()
    state = ckpt["state_dict"]
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    name = type(model).__name__
    if missing or unexpected:
        raise ConfigError(field, f"a checkpoint of the {name} this config builds (the file holds "
                                 f"{_names(state)}, the model has {_names(expected)})", str(path))
    for key, value in expected.items():
        if tuple(state[key].shape) != tuple(value.shape):
            raise ConfigError(field, f"a checkpoint of the {name} this config builds: '{key}' is "
                                     f"{list(state[key].shape)} in the file, {list(value.shape)} in the model "
                                     "(the model's or the data's sizes differ)", str(path))


def _names(state: dict, most: int = 6) -> str:
    keys = list(state)
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "") if keys else "nothing"
