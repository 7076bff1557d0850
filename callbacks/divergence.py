"""Stop a run that blows up or turns NaN/inf, naming the step, the quantity and the fix to try."""
import math
import weakref
from collections import deque

import lightning as L
import torch

from featlearn.callbacks.logged_values import callback_metrics, read_floats
from featlearn.errors import ConfigError, DivergenceError

QUANTITIES = ("loss", "weight_norm")
_HEAD = 4  # each buffered step: [first loss value, loss finite, |loss|, weight norm, parameter norms.., metrics..]


class DivergenceGuard(L.Callback):
    """Raise :class:`~featlearn.errors.DivergenceError` when training diverges.

    Two kinds of divergence:

    * **non-finite**: the loss, a logged metric or a parameter is NaN/inf;
    * **blow-up**: a watched quantity (``|loss|``, or the global norm of the trainable parameters) is
      more than ``growth`` times its smallest value over the previous ``window`` steps. Each method sets
      its defaults in ``blowup_factors`` (``None``: not watched); ``loss_growth`` / ``weight_growth``
      override them.

    A quantity above the square root of its factor marks the run *suspect*:
    :class:`~featlearn.callbacks.FinalCheckpoint` postpones its saves while a run is suspect, so the
    checkpoint left behind predates the blow-up. Resume it with a smaller learning rate (the config's
    optimizer settings replace the checkpoint's, see ``FeatureLearningModule.on_load_checkpoint``)::

        lightning fit --config CONFIG --ckpt_path .../last.ckpt --model.init_args.lr SMALLER

    **When it looks.** Each step's checks stay on the device: its loss, its logged scalars and its parameter
    norms, kept as they are and converted to float64 only when read (a step costs the norms and a few list
    appends, whatever the number of metrics). A step makes no host sync, so the GPU queue never drains for
    the guard. Every ``check_every_n_steps`` steps (``None``: the trainer's
    ``log_every_n_steps``, when Lightning reads the metrics anyway), before any checkpoint save, while a
    save is postponed, and at the end of training, the kept steps are read in one transfer (and, on
    several devices, their verdicts reduced once) and judged in order, each against the steps before it,
    exactly as if it had been judged at its own step; the message names the step where the divergence
    began, not the one where it was read. The trade-off of an interval above 1: the run goes on for up to
    ``check_every_n_steps - 1`` steps after it diverged, and a NaN/inf loss's update reaches the weights
    (it is not stopped before backward). No checkpoint is ever saved after a diverged step (every save
    reads the kept steps first, and refuses), so the checkpoint the message names still predates it. With
    ``check_every_n_steps=1`` the loss is checked before backward, so that step never reaches the weights,
    at the price of two host syncs per step.

    Example:
        >>> trainer = L.Trainer(callbacks=[DivergenceGuard(weight_growth=10.0)])  # doctest: +SKIP
    """

    def __init__(self, loss_growth: float | None = None, weight_growth: float | None = None, window: int = 20,
                 check_every_n_steps: int | None = None):
        every = check_every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ConfigError("divergence.check_every_n_steps", "an integer >= 1 or null", check_every_n_steps)
        self.loss_growth, self.weight_growth, self.window = loss_growth, weight_growth, window
        self.check_every_n_steps = check_every_n_steps
        self.history: deque = deque(maxlen=window)   # (step, {quantity: value}) of the previous steps
        self.suspect = False
        self._pending: list = []        # (meta, (loss checks, loss, norms, logged values)) of the steps not read yet
        self._loss = None               # this step's backward passes: (loss copy, None) or (first value, all finite)
        self._loss_step = None          # the global step its loss was computed at
        self._trainer = None            # weak reference, to read the pending steps before a state_dict

    def factors(self, pl_module) -> dict[str, float]:
        """The growth factor of each watched quantity: this guard's settings, else the method's defaults."""
        defaults = getattr(pl_module, "blowup_factors", {})
        chosen = {"loss": self.loss_growth, "weight_norm": self.weight_growth}
        out = {q: chosen[q] if chosen[q] is not None else defaults.get(q) for q in QUANTITIES}
        return {q: f for q, f in out.items() if f is not None}

    def interval(self, trainer) -> int:
        """Steps between two reads of the kept checks."""
        n = self.check_every_n_steps
        return max(1, int(n if n is not None else (getattr(trainer, "log_every_n_steps", None) or 1)))

    # --- hooks ------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = weakref.ref(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        self._trainer = weakref.ref(trainer)
        if _judges_seeds(pl_module):
            return
        self._pending, self._loss = [], None
        if not self.history:  # the initial weights are the first reference: a first step can blow up too
            self.history.append((trainer.global_step, {"loss": 0.0, "weight_norm": float(_weight_norm(pl_module))}))

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if _judges_seeds(pl_module):  # several seeds in one run: each is judged alone (SeedStack.guard)
            return
        if self.interval(trainer) == 1:  # read now: the step is never applied
            if not bool(torch.isfinite(loss).all()):
                self._stop(trainer.global_step, trainer.current_epoch, f"train loss is {float(loss.flatten()[0])}",
                           "The step was not applied. " + _checkpoint_note(trainer, pl_module))
            return
        # kept until the next read: a copy (a compiled step's CUDA graph may reuse its output's memory at the
        # next replay); a loss of several values as two scalars
        loss = loss.detach()
        check = (loss.clone(), None) if loss.dim() == 0 else (loss.flatten()[0].clone(), torch.isfinite(loss).all())
        if self._loss is None:
            self._loss, self._loss_step = [], trainer.global_step
        self._loss.append(check)  # several backward passes in one step: the first non-finite one counts

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if _judges_seeds(pl_module):
            return
        self._push(trainer, pl_module, outputs)
        step = trainer.global_step
        if step % self.interval(trainer) == 0 or any(save_may_fall_due(c, step) for c in trainer.checkpoint_callbacks):
            self.check_now(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.check_now(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Another error stopped a run whose kept steps had diverged (NaN weights can break the method's
        own code before the next read): say so under the error. Read locally, without a reduction."""
        pending, self._pending, self._loss = self._pending, [], None
        if not pending or isinstance(exception, DivergenceError) or not hasattr(exception, "add_note"):
            return
        try:
            found = self._judge(trainer, pl_module, pending, reduce=False)
        except Exception:  # a broken device cannot be read: the original error says more
            return
        if found is not None:
            exception.add_note(f"DivergenceGuard: before this error, {found}")

    def state_dict(self) -> dict:
        trainer = self._trainer() if self._trainer is not None else None
        if self._pending and trainer is not None and trainer.lightning_module is not None:
            self.check_now(trainer, trainer.lightning_module)  # a checkpoint holds every finished step
        return {"history": list(self.history), "suspect": self.suspect}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = deque(state_dict["history"], maxlen=self.window)
        self.suspect = state_dict["suspect"]
        self._pending, self._loss = [], None

    # --- the checks ---------------------------------------------------------------------------------
    def _push(self, trainer, pl_module, outputs) -> None:
        """Keep this step's checks on the device, without a host sync: references to its logged values (Lightning
        never writes them in place), a copy of its loss, and its parameter norms (the parameters change in place).
        The float64 rows are built when they are read (:meth:`_rows`): converting each of a method's dozens of
        logged scalars here, one op each, cost more than its whole step."""
        metrics = {n: v for n, v in callback_metrics(trainer).items() if torch.is_tensor(v) and v.numel() == 1}
        params = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if torch.is_tensor(loss) and loss.numel() > 0:  # |loss|, watched for growth: of several values, the largest
            loss = loss.detach().reshape(()).clone() if loss.numel() == 1 else loss.detach().abs().amax()
        else:
            loss = None
        norms = [torch.linalg.vector_norm(p.detach(), dtype=torch.float64) for _, p in params]
        values = [v if v.dim() == 0 else v.reshape(()) for v in metrics.values()]
        step = trainer.global_step
        loss_step = self._loss_step if self._loss is not None else step
        meta = (step, trainer.current_epoch, loss_step, tuple(n for n, _ in params), tuple(metrics))
        self._pending.append((meta, (self._loss or [], loss, norms, values)))
        self._loss = self._loss_step = None

    @staticmethod
    def _rows(pending: list) -> list[list[float]]:
        """Each kept step's row ``[first loss value, loss finite, |loss|, weight norm, parameter norms.., metrics..]``
        as Python floats, all steps read in one transfer (:func:`read_floats`)."""
        kept = [t for _, (checks, loss, norms, values) in pending
                for t in [*(x for pair in checks for x in pair if x is not None), *([loss] if loss is not None else []),
                          *norms, *values]]
        read, rows = iter(read_floats(kept)), []
        for _, (checks, loss, norms, values) in pending:
            first, finite = 0.0, True
            for _, whole in checks:  # the latest loss while all were finite, else the first non-finite one
                value = next(read)
                ok = math.isfinite(value) if whole is None else next(read) == 1.0
                if finite:
                    first, finite = value, ok
            abs_loss = abs(next(read)) if loss is not None else 0.0
            norm_values = [next(read) for _ in norms]
            rows.append([first, float(finite), abs_loss, math.hypot(*norm_values), *norm_values,
                         *(next(read) for _ in values)])
        return rows

    def check_now(self, trainer, pl_module) -> None:
        """Read the kept steps (one transfer; one reduction across processes) and judge them in order;
        raise :class:`~featlearn.errors.DivergenceError` at the first that diverged. A no-op when
        nothing is kept (every process keeps the same steps, so all of them read together)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        found = self._judge(trainer, pl_module, pending, reduce=trainer.world_size > 1)
        if found is not None:
            raise DivergenceError(found)

    def _judge(self, trainer, pl_module, pending: list, reduce: bool) -> str | None:
        """The stop message of the first diverged step of ``pending``, else None (the history and the
        suspect flag then include every step)."""
        rows = self._rows(pending)
        factors = self.factors(pl_module)
        scale = getattr(pl_module, "weight_norm_scale", None)
        before, judged = list(self.history), []
        verdicts, flags, stopped = [], [], False
        for (meta, _), row in zip(pending, rows):
            if stopped:  # the steps after a divergence do not matter
                verdicts.append((None, meta[0], False))
                flags.append([1.0, 0.0])
                continue
            reason, at, suspect, current = self._judge_step(meta, row, factors, scale)
            verdicts.append((reason, at, suspect))
            flags.append([float(reason is not None), float(suspect)])
            stopped = reason is not None
            if not stopped:
                self.history.append((meta[0], current))
                judged.append((meta[0], current))
        if reduce:  # one reduction for all the steps: any process that diverged or is suspect counts
            flags = trainer.strategy.reduce(torch.tensor(flags, dtype=torch.float32, device=pl_module.device),
                                            reduce_op="sum").reshape(-1, 2).tolist()
        for i, ((meta, _), (reason, at, _), (diverged, _)) in enumerate(zip(pending, verdicts, flags)):
            if diverged > 0:  # the history then ends before that step, as if each step had been read at once
                self.history = deque(before + judged[:i], maxlen=self.window)
                return self._message(trainer, pl_module, at, meta[1], reason or "another process diverged",
                                     reason is not None and reason.startswith("train loss"), pending[-1][0][0])
        self.suspect = flags[-1][1] > 0
        return None

    def _judge_step(self, meta, row: list, factors: dict, scale: float | None = None):
        """Today's per-step rules on one kept step: (reason or None, the step it names, suspect, values).
        ``scale``: the module's ``weight_norm_scale``, the weight norm's reference while the window's smallest
        is below it (weights that start at 0 would otherwise have their first jump as the reference)."""
        step, _, loss_step, params, metrics = meta
        first, loss_finite, abs_loss, weight_norm = row[:_HEAD]
        norms, values = row[_HEAD:_HEAD + len(params)], row[_HEAD + len(params):]
        current = {"loss": abs_loss, "weight_norm": weight_norm}
        reason, at = None, step
        bad_metric = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        if loss_finite != 1.0:
            reason, at = f"train loss is {first}", loss_step
        elif bad_metric is not None:
            reason = f"metric '{metrics[bad_metric]}' is {values[bad_metric]}"
        elif not math.isfinite(weight_norm):
            bad = next((params[i] for i, v in enumerate(norms) if not math.isfinite(v)), None)
            reason = f"parameter '{bad}' is not finite" if bad is not None else f"the weight norm is {weight_norm}"
        suspect = False
        for quantity, factor in factors.items():
            past = [(v[quantity], s) for s, v in self.history if v[quantity] > 0]
            floor = scale if quantity == "weight_norm" else None
            if past and (floor is None or min(past)[0] >= floor):
                smallest, where = min(past)
                against = f"its smallest value over the last {len(self.history)} steps ({smallest:.3g} at step {where})"
            elif floor is not None:
                smallest, against = floor, f"the method's weight_norm_scale {floor:.3g} (weights that start at 0)"
            else:
                continue
            ratio = current[quantity] / smallest
            if reason is None and ratio > factor:
                reason = (f"{quantity.replace('_', ' ')} {current[quantity]:.3g} is {ratio:.3g}x {against}; "
                          f"the limit is {factor:g}x (divergence.{quantity.split('_')[0]}_growth)")
            suspect |= ratio > math.sqrt(factor)
        return reason, at, suspect, current

    def _message(self, trainer, pl_module, step: int, epoch: int, what: str, loss: bool, read_at: int) -> str:
        n, late = self.interval(trainer), ""
        if loss:
            late = ("Its update was applied (divergence.check_every_n_steps: 1 stops a NaN/inf loss before "
                    "backward). ")
        if read_at > step:
            late += (f"Read at step {read_at} (the guard reads its checks every {n} steps, "
                     f"divergence.check_every_n_steps, and before each save); no checkpoint was saved in between. ")
        return (f"training diverged at global step {step} (epoch {epoch}): {what}. {late}"
                f"{_checkpoint_note(trainer, pl_module)}")

    @staticmethod
    def _stop(step: int, epoch: int, what: str, note: str) -> None:
        raise DivergenceError(f"training diverged at global step {step} (epoch {epoch}): {what}. {note}")


def save_may_fall_due(callback, step: int) -> bool:
    """Whether ``callback`` (a ``ModelCheckpoint``) may save at the end of this step: its step interval
    falls due, a save waits (postponed while suspect), or it saves by time (then it already syncs every
    step to agree on the time)."""
    every = getattr(callback, "_every_n_train_steps", 0) or 0
    return ((every >= 1 and step % every == 0) or bool(getattr(callback, "_postponed", False))
            or getattr(callback, "_train_time_interval", None) is not None)


def check_guards(trainer) -> None:
    """Have every :class:`DivergenceGuard` of ``trainer`` read its kept steps now (before a save)."""
    if _judges_seeds(trainer.lightning_module):
        trainer.lightning_module.guard.check()
        return
    for callback in trainer.callbacks:
        if isinstance(callback, DivergenceGuard) and trainer.lightning_module is not None:
            callback.check_now(trainer, trainer.lightning_module)


def _judges_seeds(pl_module) -> bool:
    """A :class:`~featlearn.lightning_modules.seeds.SeedStack` judges each of its seeds alone."""
    return getattr(pl_module, "judges_seeds", False)


def _weight_norm(pl_module) -> torch.Tensor:
    """Global L2 norm of the trainable parameters, in float64, on their device."""
    # vector_norm accumulates in float64 without a float64 copy of each parameter (20x faster for a 512^2 Q)
    norms = [torch.linalg.vector_norm(p.detach(), dtype=torch.float64) for p in pl_module.parameters()
             if p.requires_grad]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float64)


def step_size_options(pl_module) -> list[str]:
    """The command-line options of ``pl_module``'s step-size fields (its ``step_size_fields``): a module
    without ``lr`` (two-layer: ``lr1_mult``, ``lr3_mult``) must not be told to change it."""
    return [f"--model.init_args.{name}" for name in getattr(pl_module, "step_size_fields", ("lr",))]


def _checkpoint_note(trainer, pl_module=None) -> str:
    """Where to go on from, and how."""
    options = step_size_options(pl_module if pl_module is not None else trainer.lightning_module)
    callback = trainer.checkpoint_callback
    path = getattr(callback, "last_model_path", "") if callback is not None else ""
    if not path:
        return ("No checkpoint was saved before this step (see checkpoint.every_n_train_steps). To try: a "
                f"smaller learning rate ({' or '.join(options)})")
    step = torch.load(path, map_location="cpu", weights_only=False).get("global_step", "?")
    return (f"The last checkpoint before the blow-up is {path} (step {step}). To try: a smaller learning rate "
            f"({' or '.join(options)}), resumed from it: lightning fit --config CONFIG --ckpt_path {path} "
            f"{options[0]} SMALLER (the config's optimizer settings replace the checkpoint's)")
