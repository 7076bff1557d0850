"""Stop a run that blows up or turns NaN/inf, naming the step, the quantity and the fix to try."""
import math
from collections import deque

import lightning as L
import torch

from featlearn.errors import DivergenceError

QUANTITIES = ("loss", "weight_norm")


class DivergenceGuard(L.Callback):
    """Raise :class:`~featlearn.errors.DivergenceError` as soon as training diverges.

    Two kinds of divergence:

    * **non-finite**: the loss is checked before backward (so that step never reaches the weights),
      logged metrics and parameters after each step;
    * **blow-up**: a watched quantity (``|loss|``, or the global norm of the trainable parameters) is
      more than ``growth`` times its smallest value over the previous ``window`` steps. Each method sets
      its defaults in ``blowup_factors`` (``None``: not watched); ``loss_growth`` / ``weight_growth``
      override them.

    A quantity above the square root of its factor marks the run *suspect*:
    :class:`~featlearn.callbacks.FinalCheckpoint` postpones its saves while a run is suspect, so the
    checkpoint left behind predates the blow-up. Resume it with a smaller learning rate (the config's
    optimizer settings replace the checkpoint's, see ``FeatureLearningModule.on_load_checkpoint``)::

        lightning fit --config CONFIG --ckpt_path .../last.ckpt --model.init_args.lr SMALLER

    Example:
        >>> trainer = L.Trainer(callbacks=[DivergenceGuard(weight_growth=10.0)])  # doctest: +SKIP
    """

    def __init__(self, loss_growth: float | None = None, weight_growth: float | None = None, window: int = 20):
        self.loss_growth, self.weight_growth, self.window = loss_growth, weight_growth, window
        self.history: deque = deque(maxlen=window)   # (step, {quantity: value}) of the previous steps
        self.suspect = False

    def factors(self, pl_module) -> dict[str, float]:
        """The growth factor of each watched quantity: this guard's settings, else the method's defaults."""
        defaults = getattr(pl_module, "blowup_factors", {})
        chosen = {"loss": self.loss_growth, "weight_norm": self.weight_growth}
        out = {q: chosen[q] if chosen[q] is not None else defaults.get(q) for q in QUANTITIES}
        return {q: f for q, f in out.items() if f is not None}

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.history:  # the initial weights are the first reference: a first step can blow up too
            self.history.append((trainer.global_step, {"loss": 0.0, "weight_norm": float(_weight_norm(pl_module))}))

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if not bool(torch.isfinite(loss).all()):
            self._stop(trainer, f"train loss is {float(loss.flatten()[0])}",
                       "The step was not applied. " + _checkpoint_note(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = [v for v in trainer.callback_metrics.values() if torch.is_tensor(v) and v.numel() == 1]
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # one host sync per step: every check is reduced to a few numbers on the device first
        values = torch.stack([
            loss.detach().abs().reshape(()).to(torch.float64) if torch.is_tensor(loss) else torch.zeros((), dtype=torch.float64),
            _weight_norm(pl_module),
            torch.stack([torch.isfinite(m.detach()).all() for m in metrics]).all().to(torch.float64)
            if metrics else torch.ones((), dtype=torch.float64),
        ]).tolist()
        current = {"loss": values[0], "weight_norm": values[1]}
        reason = None
        if values[2] != 1.0:
            name = next(n for n, v in trainer.callback_metrics.items()
                        if torch.is_tensor(v) and v.numel() == 1 and not torch.isfinite(v).all())
            reason = f"metric '{name}' is {float(trainer.callback_metrics[name])}"
        elif not math.isfinite(current["weight_norm"]):
            name = next(n for n, p in pl_module.named_parameters() if not torch.isfinite(p).all())
            reason = f"parameter '{name}' is not finite"
        suspect = False
        for quantity, factor in self.factors(pl_module).items():
            past = [(v[quantity], s) for s, v in self.history if v[quantity] > 0]
            if reason is None and past:
                smallest, at = min(past)
                ratio = current[quantity] / smallest
                if ratio > factor:
                    reason = (f"{quantity.replace('_', ' ')} {current[quantity]:.3g} is {ratio:.3g}x its smallest "
                              f"value over the last {len(self.history)} steps ({smallest:.3g} at step {at}); "
                              f"the limit is {factor:g}x (divergence.{quantity.split('_')[0]}_growth)")
                suspect |= ratio > math.sqrt(factor)
        diverged, self.suspect = reason is not None, suspect
        if trainer.world_size > 1:  # one reduction for both decisions: any rank that diverged or is suspect counts
            flags = torch.tensor([diverged, suspect], dtype=torch.float32, device=pl_module.device)
            diverged, self.suspect = (v > 0 for v in trainer.strategy.reduce(flags, reduce_op="sum").tolist())
        if diverged:
            self._stop(trainer, reason or "another process diverged", _checkpoint_note(trainer))
        self.history.append((trainer.global_step, current))

    def state_dict(self) -> dict:
        return {"history": list(self.history), "suspect": self.suspect}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = deque(state_dict["history"], maxlen=self.window)
        self.suspect = state_dict["suspect"]

    @staticmethod
    def _stop(trainer, what: str, note: str) -> None:
        raise DivergenceError(f"training diverged at global step {trainer.global_step} "
                              f"(epoch {trainer.current_epoch}): {what}. {note}")


def _weight_norm(pl_module) -> torch.Tensor:
    """Global L2 norm of the trainable parameters, in float64, on their device."""
    # vector_norm accumulates in float64 without a float64 copy of each parameter (20x faster for a 512^2 Q)
    norms = [torch.linalg.vector_norm(p.detach(), dtype=torch.float64) for p in pl_module.parameters()
             if p.requires_grad]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float64)


def _checkpoint_note(trainer) -> str:
    """Where to go on from, and how."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, "last_model_path", "") if callback is not None else ""
    if not path:
        return ("No checkpoint was saved before this step (see checkpoint.every_n_train_steps). To try: a "
                "smaller learning rate (--model.init_args.lr)")
    step = torch.load(path, map_location="cpu", weights_only=False).get("global_step", "?")
    return (f"The last checkpoint before the blow-up is {path} (step {step}). To try: a smaller learning rate, "
            f"resumed from it: lightning fit --config CONFIG --ckpt_path {path} --model.init_args.lr SMALLER "
            f"(the config's optimizer settings replace the checkpoint's)")
