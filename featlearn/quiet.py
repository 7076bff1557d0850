"""Lightning messages that do not apply to featlearn runs, silenced for every run (`lightning fit` and the
experiments): the litlogger advert; the "smaller than the logging interval" warning of full-batch runs,
which have one batch an epoch but log every n steps across epochs; "val_dataloader but no
validation_step" for methods that do not validate; a torch deprecation inside Lightning's own pytree
code; LightningCLI's note on ``args=`` when a run is built from Python.

Example:
    >>> from featlearn.quiet import quiet_known_noise
    >>> quiet_known_noise(); quiet_known_noise()  # idempotent
"""
import logging
import warnings

_NOISE_LOGS = (("lightning.pytorch.utilities.rank_zero", "litlogger"),)
_NOISE_WARNINGS = (".*smaller than the logging interval.*", ".*but have no `validation_step`.*", ".*LeafSpec.*",
                   ".*args parameter is intended to run from within Python.*")


class _DropText(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_known_noise() -> None:
    """Silence the Lightning messages that do not apply to featlearn runs (idempotent)."""
    for name, text in _NOISE_LOGS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropText) and f.text == text for f in log.filters):
            log.addFilter(_DropText(text))
    for message in _NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
