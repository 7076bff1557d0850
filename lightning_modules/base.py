"""Base LightningModule: parameters are sized from the attached synthetic DataModule.

Subclasses implement :meth:`build` (create parameters from the DataModule's sizes and constants) and
may override :meth:`finish_step` (what completes an optimisation step: projections, EMA targets,
schedules), :meth:`correlations` (neuron x ground-truth-feature matrix) and :meth:`heatmaps`.
``build`` runs once in ``setup`` before any checkpoint is restored, so ``fit --ckpt_path`` and
``validate --ckpt_path`` work; tests and notebooks call ``module.attach(dm)`` directly.

Example:
    >>> class Linear(FeatureLearningModule):
    ...     def build(self, dm):
    ...         self.w = torch.nn.Parameter(torch.zeros(4, dm.features.shape[1]))
    ...     def finish_step(self, step):
    ...         self.w.clamp_(-1, 1)          # a projection: part of the step, never seen half-done
    ...     def correlations(self):
    ...         return self.w @ self.dm.features.T.to(self.w)
"""
import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

# Optimizer-state entries that are learned state rather than configuration; everything else in a param
# group (lr, weight_decay, momentum, ...) comes from the current config when a run is resumed.
_GROUP_STATE_KEYS = ("params", "initial_lr")


class FeatureLearningModule(L.LightningModule):
    blowup_factors: dict[str, float | None] = {"loss": None, "weight_norm": 100.0}
    """Per-method defaults of :class:`~featlearn.callbacks.DivergenceGuard`: a quantity that grows past
    this factor of its smallest value over the guard's window is a blow-up (``None``: not watched)."""

    def __init__(self):
        super().__init__()
        self._dm = None
        self.built = False

    @property
    def dm(self):
        """The synthetic DataModule this module learns from."""
        if self._dm is None and self._trainer is not None:
            self._dm = self.trainer.datamodule
        if self._dm is None:
            raise RuntimeError("no DataModule attached: call module.attach(dm) or fit with a datamodule")
        return self._dm

    def build(self, dm) -> None:
        raise NotImplementedError

    def attach(self, dm) -> "FeatureLearningModule":
        """Build parameters for ``dm`` (once) and remember it. Returns self."""
        self._dm = dm
        if not self.built:
            self.build(dm)
            self.built = True
        return self

    def setup(self, stage: str) -> None:
        self.attach(self.trainer.datamodule)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        optimizer.step(closure=optimizer_closure)
        # Inside the optimisation step, so every callback (checkpoints included) sees finished steps only.
        with torch.no_grad():
            self.finish_step(self.global_step + 1)  # Lightning counts the step once this hook returns

    def finish_step(self, step: int) -> None:
        """Complete optimisation step number ``step`` (1 for the first), whose update was just applied."""

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Resume with the optimizer settings of the current config (e.g. a lowered ``lr`` after a
        blow-up), keeping the optimizer's learned state (momentum buffers)."""
        states = checkpoint.get("optimizer_states") or []
        fresh = self.configure_optimizers()
        fresh = fresh if isinstance(fresh, (list, tuple)) else [fresh]
        for state, optimizer in zip(states, fresh):
            for old, new in zip(state["param_groups"], optimizer.param_groups):
                for key, value in new.items():
                    if key not in _GROUP_STATE_KEYS and old.get(key) != value:
                        rank_zero_info(f"resume: optimizer {key} {old.get(key)!r} -> {value!r} (from the config)")
                        old[key] = value

    def correlations(self) -> torch.Tensor:
        """Neuron x feature correlation matrix ``[R, F]``."""
        raise NotImplementedError

    def heatmaps(self) -> dict[str, torch.Tensor]:
        """2-D tensors logged as TensorBoard images by :class:`featlearn.callbacks.HeatmapLogger`."""
        return {"correlation": self.correlations()}
