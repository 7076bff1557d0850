"""Log the spectrum of a method's representation: its stable and effective rank on validation samples, where
dimensional collapse shows up first (:mod:`featlearn.metrics.spectrum`)."""
import lightning as L
import torch

from featlearn.metrics.figures import tensorboard_writer
from featlearn.metrics.spectrum import effective_rank, stable_rank


class RepresentationSpectrum(L.Callback):
    """Every ``every_n_steps`` training steps (0: never) log ``val/stable_rank`` and ``val/effective_rank``
    of ``pl_module.representation(batch)`` ``[n, m]`` on the first ``num_samples`` validation samples. Methods
    without a ``representation`` are skipped, as are several seeds trained in one run (their stack has none).

    Example:
        >>> trainer = L.Trainer(callbacks=[RepresentationSpectrum(every_n_steps=100)])  # doctest: +SKIP
    """

    def __init__(self, every_n_steps: int = 100, num_samples: int = 512):
        self.every_n_steps, self.num_samples = every_n_steps, num_samples

    def measure(self, trainer, pl_module) -> dict[str, float] | None:
        represent = getattr(pl_module, "representation", None)
        dm = trainer.datamodule
        if represent is None or dm is None:
            return None
        n = min(self.num_samples, dm.sizes["val"])
        batch = {k: v.to(pl_module.device) for k, v in dm.batch(torch.arange(n), "val").items()}
        with torch.no_grad():
            F = represent(batch)
        if F is None:  # the method defines no representation
            return None
        return {"val/stable_rank": stable_rank(F), "val/effective_rank": effective_rank(F)}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.every_n_steps or trainer.global_step % self.every_n_steps:
            return
        # written directly, as the heat maps are: self.log would keep only steps on log_every_n_steps' grid
        writer = tensorboard_writer(trainer)  # rank zero's (every rank would measure the same samples)
        measured = self.measure(trainer, pl_module) if writer is not None else None
        for tag, value in (measured or {}).items():
            writer.add_scalar(tag, value, trainer.global_step)
