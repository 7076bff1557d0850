"""Base LightningModule: parameters are sized from the attached synthetic DataModule.

Subclasses implement :meth:`build` (create parameters from the DataModule's sizes and constants) and
may override :meth:`correlations` (neuron x ground-truth-feature matrix) and :meth:`heatmaps`.
``build`` runs once in ``setup`` before any checkpoint is restored, so ``fit --ckpt_path`` and
``validate --ckpt_path`` work; tests and notebooks call ``module.build(dm)`` directly.

Example:
    >>> class Linear(FeatureLearningModule):
    ...     def build(self, dm):
    ...         self.w = torch.nn.Parameter(torch.zeros(4, dm.features.shape[1]))
    ...     def correlations(self):
    ...         return self.w @ self.dm.features.T.to(self.w)
"""
import lightning as L
import torch


class FeatureLearningModule(L.LightningModule):
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
            raise RuntimeError("no DataModule attached: call module.build(dm) or fit with a datamodule")
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

    def correlations(self) -> torch.Tensor:
        """Neuron x feature correlation matrix ``[R, F]``."""
        raise NotImplementedError

    def heatmaps(self) -> dict[str, torch.Tensor]:
        """2-D tensors logged as TensorBoard images by :class:`featlearn.callbacks.HeatmapLogger`."""
        return {"correlation": self.correlations()}
