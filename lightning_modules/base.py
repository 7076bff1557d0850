"""Base LightningModule: a method declares the DataModule it pairs with and is built from it once.

The interface between a method and its data:

* ``datamodule_class``: the synthetic DataModule the method pairs with; the CLI refuses another one
  before any work, naming ``data.class_path``.
* :meth:`build` ``(dm)``: the one place a module reads its DataModule. It creates the parameters from the
  data's sizes, keeps the sizes it needs as attributes and the ground truth as buffers
  (:meth:`register_ground_truth`). ``build`` runs once (``attach``), from the CLI before fitting or from
  ``setup``, before any checkpoint is restored, so ``fit --ckpt_path`` and ``validate --ckpt_path`` work;
  tests and notebooks call ``module.attach(dm)`` directly. Steps never look at the DataModule.

What a method may override: :meth:`finish_step` (what completes an optimisation step: projections, EMA
targets, schedules), :meth:`correlations` (neuron x ground-truth-feature matrix, drawn as a heat map with
``heatmap_axes`` and the fixed colour scale ``heatmap_scale``), :meth:`heatmaps` and :meth:`final_metrics`
(the results shown in TensorBoard's HPARAMS tab). Theory metrics that cost more than a few elementwise
operations are computed only when :meth:`theory_due`, i.e. every ``trainer.log_every_n_steps`` steps.

Example:
    >>> class Linear(FeatureLearningModule):
    ...     def build(self, dm):
    ...         self.w = torch.nn.Parameter(torch.zeros(4, dm.features.shape[1]))
    ...         self.register_ground_truth("features", dm.features)
    ...     def finish_step(self, step):
    ...         self.w.clamp_(-1, 1)          # a projection: part of the step, never seen half-done
    ...     def correlations(self):
    ...         return self.w @ self.features.T
"""
import inspect

import lightning as L
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.profiler import record_function

from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.lightning_modules.hook_name import HookNameFastPath
from featlearn.metrics.figures import HeatmapFrames, log_results, plt, tensorboard_writer

_LOG_SIGNATURE = inspect.signature(L.LightningModule.log)

# Optimizer-state entries that are learned state rather than configuration; everything else in a param
# group (lr, weight_decay, momentum, ...) comes from the current config when a run is resumed.
_GROUP_STATE_KEYS = ("params", "initial_lr")


class FeatureLearningModule(HookNameFastPath, L.LightningModule):
    datamodule_class: type = SyntheticDataModule
    """The DataModule this method learns from (the CLI refuses a config with another one)."""
    heatmap_axes: tuple[str, str] = ("neuron", "feature")
    """Axis labels of the correlation heat map (rows, columns)."""
    heatmap_scale: float = 1.0
    """The colour-scale limit of the heat maps, fixed so that frames of one run can be compared."""
    blowup_factors: dict[str, float | None] = {"loss": None, "weight_norm": 100.0}
    """Per-method defaults of :class:`~featlearn.callbacks.DivergenceGuard`: a quantity that grows past
    this factor of its smallest value over the guard's window is a blow-up (``None``: not watched)."""
    weight_norm_scale: float | None = None
    """Weights that start at 0 have no initial norm to measure growth from: the guard then measures the
    weight norm against this scale while the smallest over its window is below it (``None``: no scale)."""
    samples_needed: bool = True
    """False where the training loss never reads the batch (a closed-form population loss): the DataModule
    then hands ``training_step`` the batch's indices only and draws no samples."""
    seeds_vmap: bool = False
    """Whether several seeds in one run (:mod:`featlearn.lightning_modules.seeds`) compute this method's loss in
    one ``torch.func.vmap`` call of :meth:`seed_loss` (then ``training_step`` computes what
    ``record_step(seed_loss(batch), batch)`` does); otherwise each seed runs its own ``training_step`` in turn."""
    finishes_seeds: bool = False
    """Whether :meth:`finish_seeds` does the weight-only part of :meth:`finish_step` for every seed of a stack at
    once (a projection with a leading seed axis); ``finish_step`` then leaves it out when in a stack."""
    representation_input: str | None = None
    """The batch key of the inputs whose ``self(batch[key])`` is the method's representation (None: the method
    has no ``forward`` representation; it may still override :meth:`representation`)."""
    step_size_fields: tuple[str, ...] = ("lr",)
    """The ``__init__`` arguments that set the step size, which a divergence message tells the user to lower."""
    compiled_loss: str | None = None
    """The method (by name) that ``model.compile`` runs under ``torch.compile``: the step's loss from the
    weights and the batch, fused ops included (in their PyTorch form), logging outside it. What changes with
    the step (a schedule's scale) comes in as an argument, never read inside: a value read there is frozen
    into the compiled code and recompiles it at every step. None: not offered."""
    compile_pays_after: int | None = None
    """Training steps after which compiling :attr:`compiled_loss` has repaid its compile time, measured on the
    CPU at the method's tiny size (docs/performance.md); ``model.compile: null`` compiles runs at least this
    long. None: never by default (compiling does not pay, or was not measured)."""

    def __init__(self):
        super().__init__()
        self.built = False

    def build(self, dm) -> None:
        raise NotImplementedError

    def attach(self, dm) -> "FeatureLearningModule":
        """Build parameters from ``dm`` (once; the DataModule is not kept). Returns self."""
        paired = self.datamodule_class
        if not isinstance(dm, paired):
            raise ConfigError("data.class_path", f"{paired.__module__}.{paired.__name__} (the DataModule "
                                                 f"{type(self).__name__} pairs with)",
                              f"{type(dm).__module__}.{type(dm).__name__}")
        self.compile_wanted(0)  # refuses a compile it cannot do, before any work
        if not self.built:
            self.build(dm)
            self.built = True
        return self

    def setup(self, stage: str) -> None:
        self.attach(self.trainer.datamodule)
        wanted = self.hparams.get("compile")
        if stage != "fit" or self.compiled_loss is None or wanted is False:
            return
        device = self.trainer.strategy.root_device.type  # the module moves there after this hook
        if wanted is None and (self.compile_pays_after is None or device != "cpu"):
            return
        # the step count only where it decides (estimating it can load the training dataloader early)
        if self.compile_wanted(self.trainer.estimated_stepping_batches if wanted is None else 0, device):
            self.compile_loss()

    def compile_wanted(self, steps: float, device: str = "cpu") -> bool:
        """Whether a run of ``steps`` training steps compiles the loss: ``model.compile`` if set, else CPU runs at
        least :attr:`compile_pays_after` steps long (on a GPU the fused Triton kernels stay until a GPU
        measurement says otherwise). Refuses ``true`` where it is not offered (naming the field).

        Example:
            >>> class Method(FeatureLearningModule):
            ...     compiled_loss, compile_pays_after = "loss", 2000
            >>> Method().compile_wanted(500), Method().compile_wanted(5000)
            (False, True)
        """
        wanted = self.hparams.get("compile")
        if wanted and self.compiled_loss is None:
            raise ConfigError("model.compile", f"false or null: {type(self).__name__} offers no compiled loss", wanted)
        if wanted and self.hparams.get("backend") == "triton":
            raise ConfigError("model.compile", "false or null with model.backend triton (a compiled loss runs the "
                                               "fused ops' PyTorch form; torch.compile makes its own kernels)", wanted)
        if wanted is None:
            return device == "cpu" and self.compile_pays_after is not None and steps >= self.compile_pays_after
        return wanted

    def compile_loss(self, compiler: str = "inductor", mode: str | None = None) -> None:
        """Replace this module's :attr:`compiled_loss` by its ``torch.compile`` (once) with ``compiler`` (the
        ``torch.compile`` backend; the GPU tests take ``aot_eager``: the same traced graphs without inductor's
        compile time) and inductor's ``mode`` (``"reduce-overhead"``: CUDA graphs on a GPU, which
        ``featlearn bench step`` times on CUDA; no run sets it yet). Automatic dynamic: a float argument that
        changes (a scale) is traced as a symbol after its first change, not recompiled at each value. Backend
        ``auto`` takes the PyTorch form of the fused ops while it is traced."""
        name = self.compiled_loss
        if name is not None and name not in self.__dict__:
            self.__dict__[name] = torch.compile(getattr(self, name), backend=compiler,
                                                **({"mode": mode} if mode is not None else {}))

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        self.prepare_step(optimizer)
        optimizer.step(closure=optimizer_closure)
        # Inside the optimisation step, so every callback (checkpoints included) sees finished steps only.
        with torch.no_grad(), record_function("featlearn.metrics"):  # a phase of `featlearn profile`'s trace
            self.finish_step(self.global_step + 1)  # Lightning counts the step once this hook returns

    def representation(self, batch: dict) -> torch.Tensor | None:
        """The features ``[n, m]`` of a batch whose spectrum :class:`~featlearn.callbacks.RepresentationSpectrum`
        logs: ``self(batch[representation_input])``, or None where the method defines none."""
        key = self.representation_input
        return None if key is None else self(batch[key])

    def adam_cosine(self, lr: float, schedule: str = "cosine"):
        """Adam at ``lr`` on every parameter, annealed to 0 over the run's steps by a cosine (``schedule:
        cosine``; ``constant`` keeps it, as does a module without a Trainer): the in-context learning modules'
        ``configure_optimizers``."""
        optimizer = torch.optim.Adam(self.parameters(), lr=lr)
        if schedule == "constant" or self._trainer is None:
            return optimizer
        steps = max(1, int(self.trainer.estimated_stepping_batches))
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

    def prepare_step(self, optimizer) -> None:
        """Set what the coming step needs before its forward runs (a schedule's step sizes in ``optimizer``)."""

    def finish_seeds(self, weights: dict[str, torch.Tensor], step: int) -> None:
        """The weight-only part of :meth:`finish_step` on ``weights`` (name -> tensor, with a leading seed axis
        in a stack); see :attr:`finishes_seeds`."""
        raise NotImplementedError

    def logged(self, name: str):
        """The last value logged as ``name`` (this seed's, for one seed of several in one run), else None (also
        without a trainer)."""
        stack = self.seed_stack()
        if stack is None:
            return self._trainer.callback_metrics.get(name) if self._trainer is not None else None
        return stack.logs.last[self._seed_row].get(name)

    def finish_step(self, step: int) -> None:
        """Complete optimisation step number ``step`` (1 for the first), whose update was just applied."""

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Resume with the optimizer settings of the current config (e.g. a lowered ``lr`` after a
        blow-up), keeping the optimizer's learned state (momentum buffers). Where a scheduler owns the step
        size (the group has an ``initial_lr``), the config's ``lr`` becomes the schedule's base and the step
        size keeps the schedule's factor at the step resumed from."""
        states = checkpoint.get("optimizer_states") or []
        if not states:  # nothing to update (one seed of a stack: the stack's optimizer holds its state)
            return
        optimizers, schedulers = _optimizers_and_schedulers(self.configure_optimizers())
        saved = checkpoint.get("lr_schedulers") or []  # Lightning's order: the order configure_optimizers gives
        for state, optimizer in zip(states, optimizers):
            owned = [saved[j] for j, sched in enumerate(schedulers) if j < len(saved)
                     and getattr(sched, "optimizer", None) is optimizer]
            for g, (old, new) in enumerate(zip(state["param_groups"], optimizer.param_groups)):
                scheduled = "initial_lr" in new and "initial_lr" in old
                for key, value in new.items():
                    if key in _GROUP_STATE_KEYS or (scheduled and key == "lr"):
                        continue
                    if old.get(key) != value:
                        rank_zero_info(f"resume: optimizer {key} {old.get(key)!r} -> {value!r} (from the config)")
                        old[key] = value
                if not scheduled or old["initial_lr"] == new["initial_lr"]:
                    continue
                if not owned or any("base_lrs" not in sched or "_schedulers" in sched for sched in owned):
                    # a chained schedule keeps its base step sizes inside its parts: not rebased here
                    rank_zero_warn(f"resume: the config's lr {new['initial_lr']!r} is not applied: the checkpoint's "
                                   f"schedule of it cannot be rebased (the run keeps {old['initial_lr']!r})")
                    continue
                rank_zero_info(f"resume: optimizer lr {old['initial_lr']!r} -> {new['initial_lr']!r} before the "
                               f"schedule (from the config)")
                old["lr"] *= new["initial_lr"] / old["initial_lr"]
                old["initial_lr"] = new["initial_lr"]
                for sched in owned:
                    sched["base_lrs"][g] = new["initial_lr"]

    @property
    def hparams_initial(self):
        """The arguments as logged (``hparams.yaml``, HPARAMS tab): LightningCLI's private bookkeeping
        (``_instantiator``, ``_class_path``) stays in checkpoints only."""
        return AttributeDict(_public(super().hparams_initial))

    def register_ground_truth(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a ground-truth tensor of the DataModule (features, dictionary, ...) as ``self.<name>``: a
        buffer that follows the module's device but is not saved in checkpoints (the data rebuilds it)."""
        self.register_buffer(name, tensor.detach().clone(), persistent=False)

    def theory_due(self) -> bool:
        """Whether this training step computes and logs the theory metrics: every
        ``trainer.log_every_n_steps`` steps (Lightning's own logging interval), always without a trainer."""
        trainer = self._trainer
        # Lightning writes step metrics when the step being finished, global_step + 1, is a multiple of N
        return trainer is None or (self.global_step + 1) % max(1, trainer.log_every_n_steps) == 0

    def final_metrics(self) -> dict[str, float]:
        """The run's results (e.g. captured fraction, final loss), logged at the end of training as
        ``hp/<name>`` in TensorBoard's HPARAMS tab beside the hyperparameters of the model and the data."""
        return {}

    def on_train_end(self) -> None:
        metrics = {f"hp/{k}": float(v) for k, v in self.final_metrics().items()}
        if not metrics or self.trainer.global_rank != 0:
            return
        stack = self.seed_stack()
        data = self.trainer.datamodule if stack is None else self.trainer.datamodule.members[self._seed_row]
        params = {**(data.hparams_initial if data is not None else {}), **self.hparams_initial}
        if stack is None:
            log_results(self.trainer, params, metrics)
        else:
            stack.member_results(self, params, metrics)

    # --- one seed of several in one run (featlearn.lightning_modules.seeds) ----------------------------
    def seed_stack(self):
        """The :class:`~featlearn.lightning_modules.seeds.SeedStack` this module is one seed of, else None."""
        owner = self.__dict__.get("_seed_owner")
        return owner() if owner is not None else None

    def log(self, name: str, value, *args, **kwargs) -> None:
        """Lightning's ``self.log``; for one seed of a stack, that seed's TensorBoard run
        (:mod:`featlearn.lightning_modules.seed_logs`)."""
        stack = self.seed_stack()
        if stack is None:
            return super().log(name, value, *args, **kwargs)
        options = _LOG_SIGNATURE.bind(self, name, value, *args, **kwargs).arguments
        stack.member_log(self, name, value, **{k: v for k, v in options.items() if k not in ("self", "name", "value")})

    def summary_writer(self):
        """The TensorBoard ``SummaryWriter`` of this run (of this seed's run, for one seed of several), or None."""
        stack = self.seed_stack()
        return tensorboard_writer(self._trainer) if stack is None else stack.member_writer(self)

    def log_figure(self, tag: str, figure) -> None:
        """Log a matplotlib figure to TensorBoard at the current step (rank 0; no-op without TensorBoard)."""
        writer = self.summary_writer()
        if writer is not None:
            writer.add_figure(tag, figure, self.global_step)
        plt.close(figure)

    def log_heatmap(self, tag: str, matrix: torch.Tensor, **figure_args) -> None:
        """Log ``matrix`` as a heat map (:func:`~featlearn.metrics.figures.heatmap_figure`'s keyword arguments)
        at the current step, redrawn on the figure kept for ``tag`` (rank 0; no-op without TensorBoard)."""
        writer = self.summary_writer()
        if writer is None:
            return
        if getattr(self, "_heatmap_frames", None) is None:
            self._heatmap_frames = HeatmapFrames()
        writer.add_figure(tag, self._heatmap_frames.figure(tag, matrix, **figure_args), self.global_step, close=False)

    def on_fit_end(self) -> None:
        if getattr(self, "_heatmap_frames", None) is not None:
            self._heatmap_frames.close()

    def correlations(self) -> torch.Tensor:
        """Neuron x feature correlation matrix ``[R, F]``."""
        raise NotImplementedError

    def heatmaps(self) -> dict[str, torch.Tensor]:
        """2-D tensors logged as TensorBoard images by :class:`featlearn.callbacks.HeatmapLogger`."""
        return {"correlation": self.correlations()}


def _optimizers_and_schedulers(configured) -> tuple[list, list]:
    """The optimizers and the step-size schedulers, in Lightning's order, of whatever form
    ``configure_optimizers`` returned: one optimizer, a list, a dict with an ``optimizer`` (and its
    ``lr_scheduler``, itself a scheduler or a dict with a ``scheduler``), a list of such dicts, or
    ``(optimizers, schedulers)``.

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        >>> forms = (opt, [opt, opt], {"optimizer": opt, "lr_scheduler": {"scheduler": sched}}, ([opt], [sched]))
        >>> [tuple(map(len, _optimizers_and_schedulers(form))) for form in forms]
        [(1, 0), (2, 0), (1, 1), (1, 1)]
    """
    def scheduler(entry):
        return entry["scheduler"] if isinstance(entry, dict) else entry

    if isinstance(configured, dict):
        plan = configured.get("lr_scheduler")
        return [configured["optimizer"]], [] if plan is None else [scheduler(plan)]
    if isinstance(configured, (list, tuple)) and len(configured) == 2 and all(isinstance(c, list) for c in configured):
        return list(configured[0]), [scheduler(entry) for entry in configured[1]]
    if isinstance(configured, (list, tuple)):
        parts = [_optimizers_and_schedulers(entry) for entry in configured]
        return [o for opts, _ in parts for o in opts], [s for _, scheds in parts for s in scheds]
    return [configured], []


def _public(params: dict) -> dict:
    """Hyperparameters without LightningCLI's private bookkeeping (``_instantiator``, ``_class_path``)."""
    return {k: v for k, v in params.items() if not str(k).startswith("_")}
