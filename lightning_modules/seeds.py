"""Several seeds of one method in one run: S independent models trained by one Trainer step.

``lightning fit --config CONFIG --seeds '[0, 1, 2, 3]'`` builds the config's method and data once per seed
(seed s sets ``seed_everything``, ``data.seed`` and the model's ``seed``, as ``--seed_everything s
--data.init_args.seed s`` would alone), then trains them together, so the Trainer's fixed cost per step is
paid once for all seeds and small GEMMs become batched ones:

* **Weights.** Each trained tensor of the method is one leaf with a leading seed axis ``[S, ...]``; member s
  reads row s (and its step-finishing projections, caps and EMA updates write row s). One optimizer over the
  stacked leaves with the method's own settings: featlearn's optimizers (SGD, Adam) act elementwise, so this is
  S optimizers, each with its own state and schedule (:mod:`.seed_schedules`).
* **Loss.** Methods that define ``seed_loss(batch)`` (a pure function of the weights and the batch) run it once
  through ``torch.func.vmap`` over the seed axis, and ``record_step(loss, batch)`` per seed for the metrics:
  the same arithmetic in batched ops (equal to the separate runs to float rounding). Every other method runs
  each member's own ``training_step`` in turn and sums the losses: the gradient of the sum on row s is
  member s's own gradient, bit for bit the separate run's.
* **Data.** Member s's DataModule draws its batches as it would alone, from (seed s, index)
  (:class:`~featlearn.datamodules.seeds.SeedStackDataModule`).
* **Logs.** One TensorBoard run per seed, ``<log_dir>/seed_<s>``: its scalars, figures and HPARAMS results
  (the curves of all seeds overlay in one chart); heat maps are drawn for the first seed.
* **Divergence.** Each seed is judged alone (:mod:`featlearn.lightning_modules.seed_guard`): a seed that
  diverges stops alone, keeps its weights from before the damage in ``seed_<s>/before_divergence.ckpt``,
  and the others go on; the run fails only when every seed has.
* **Checkpoints.** The run's own checkpoints hold every seed (resume with the same ``--seeds``); at the end
  each seed's final state is written to ``seed_<s>/last.ckpt``, a checkpoint of the method itself
  (``lightning validate --config CONFIG --data.init_args.seed 3 --ckpt_path .../seed_3/last.ckpt``).

Example:
    >>> from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
    >>> from featlearn.lightning_modules.noncontrastive import NonContrastiveModule
    >>> members = [NonContrastiveModule(gradient="population").attach(TwoFeaturePatchDataModule(seed=s, dim=8))
    ...            for s in (0, 1)]
    >>> stack = SeedStack(members, seeds=[0, 1])
    >>> stack.stacked[0].shape, members[1].w.shape    # W of both seeds in one leaf; member 1 reads row 1
    (torch.Size([2, 2, 8]), torch.Size([2, 8]))
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import lightning as L
import torch

from featlearn.errors import ConfigError
from featlearn.lightning_modules.base import FeatureLearningModule, HookNameFastPath
from featlearn.lightning_modules.seed_guard import SeedGuard
from featlearn.lightning_modules.seed_logs import SeedLogs
from featlearn.lightning_modules.seed_schedules import prepare_seeds


# Lightning hooks a stack does not pass on to its members: a method that overrides one is refused
UNFORWARDED_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_train_epoch_start", "on_train_epoch_end",
                     "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
                     "configure_gradient_clipping", "on_validation_epoch_start", "on_validation_batch_end",
                     "on_test_epoch_start", "lr_scheduler_step")


class SeedStack(HookNameFastPath, L.LightningModule):
    """S members (built, one per seed, of one method) trained as one module; see the module docstring."""

    judges_seeds = True
    """The CLI's :class:`~featlearn.callbacks.DivergenceGuard` stands aside: :attr:`guard` judges each seed."""

    def __init__(self, members: list[FeatureLearningModule], seeds: list[int]):
        super().__init__()
        if not members or len(members) != len(seeds) or len(set(seeds)) != len(seeds):
            raise ConfigError("seeds", "a non-empty list of distinct seeds, one per member", seeds)
        if len({type(m) for m in members}) != 1:
            raise ConfigError("seeds", "members of one method", [type(m).__name__ for m in members])
        own = [h for h in UNFORWARDED_HOOKS if getattr(type(members[0]), h) is not getattr(L.LightningModule, h)]
        if own:
            raise ConfigError("seeds", f"a method whose Lightning hooks a stack forwards ({type(members[0]).__name__} "
                                       f"overrides {', '.join(own)}): train its seeds one run each", seeds)
        if members[0].hparams.get("compile"):  # a member's loss reads row views that change each step
            raise ConfigError("model.compile", "false or null with --seeds (several seeds in one run are not "
                                               "compiled)", True)
        self.seeds = [int(s) for s in seeds]
        self.members = torch.nn.ModuleList(members)
        first = members[0]
        self.names = [name for name, _ in first.named_parameters()]
        self.stacked = torch.nn.ParameterList()
        for name in self.names:
            rows = [m.get_parameter(name) for m in members]
            if len({tuple(r.shape) for r in rows}) != 1:
                raise ConfigError("seeds", f"seeds whose '{name}' has one shape (the data's sizes depend on the "
                                           "seed)", {s: tuple(r.shape) for s, r in zip(seeds, rows)})
            leaf = torch.nn.Parameter(torch.stack([r.detach() for r in rows]), requires_grad=rows[0].requires_grad)
            hooks = [list((r._backward_hooks or {}).values()) for r in rows]
            if any(hooks):  # a method's gradient hook (a frozen diagonal) acts on its own row
                leaf.register_hook(functools.partial(_per_row_hooks, hooks))
            self.stacked.append(leaf)
        for s, member in enumerate(members):
            for name in self.names:
                owner, leaf = _owner(member, name)
                del owner._parameters[leaf]
            object.__setattr__(member, "_seed_owner", weakref.ref(self))
            object.__setattr__(member, "_seed_row", s)
        self.alive = [True] * len(members)
        self.logs = SeedLogs(self, len(members))
        self.samples_needed = first.samples_needed
        self.guard = SeedGuard(self)
        self._bind()

    # --- the members' views of the stacked weights ---------------------------------------------
    def _bind(self) -> None:
        """Point every member at its rows (detached views: reads see the current weights, in-place writes
        under ``no_grad`` reach the stack). Again after every device move, which replaces the storage."""
        for s, member in enumerate(self.members):
            _place(member, self._rows(s))

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        if hasattr(self, "names"):
            self._bind()
        return self

    def _rows(self, s: int) -> dict[str, torch.Tensor]:
        """Seed row ``s`` of every leaf, detached."""
        return {name: leaf.detach()[s] for name, leaf in zip(self.names, self.stacked)}

    @contextlib.contextmanager
    def _rows_with_graph(self, s: int, rows: list[tuple[torch.Tensor, ...]]):
        """Member ``s`` reads its rows of the leaves' ``unbind`` (one per step: its backward stacks every seed's
        gradient once, where a separate ``leaf[s]`` per seed would add S full-size gradients)."""
        member = self.members[s]
        try:
            _place(member, {name: leaf_rows[s] for name, leaf_rows in zip(self.names, rows)})
            yield member
        finally:
            _place(member, self._rows(s))

    @property
    def batched(self) -> bool:
        """Whether the loss runs once for all seeds through vmap (the method's ``seeds_vmap``, which may depend on
        the run: several processes, a mode)."""
        return self.members[0].seeds_vmap

    live = property(lambda self: [s for s, ok in enumerate(self.alive) if ok])

    # --- the step ------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        batches = batch["seeds"]
        live = self.live
        if not live:  # every seed stopped (diverged, or its method's own stop): nothing left to train
            self.trainer.should_stop = True
            return None
        if self.batched:
            losses = self._batched_losses(batch)
            outs = []
            for s in live:  # metrics and their logs, per seed, on detached rows
                outs.append(self.members[s].record_step(losses[s], batches[s]))
            total = sum(outs)
            self.guard.record(losses.detach())
        else:
            outs, rows = {}, [leaf.unbind(0) for leaf in self.stacked]
            for s in live:
                with self._rows_with_graph(s, rows) as member:
                    out = member.training_step(batches[s], batch_idx)
                outs[s] = out["loss"] if isinstance(out, dict) else out
            total = sum(outs.values())
            self.guard.record(torch.stack([outs[s].detach().reshape(()) if s in outs else
                                           torch.zeros((), dtype=total.dtype, device=total.device)
                                           for s in range(len(self.members))]))
        return total

    def _batched_losses(self, batch: dict) -> torch.Tensor:
        first, batches = self.members[0], batch["seeds"]
        data = batch.get("stacked") or {k: torch.stack([b[k] for b in batches]) for k, v in batches[0].items()
                                         if torch.is_tensor(v)}
        members = [dict(m.named_buffers()) for m in self.members]
        now = [(b, b._version) for bufs in members for b in bufs.values()]  # most are ground truth, never written
        at = getattr(self, "_buffers_at", None)  # an in-place write or a swapped tensor: stacked again
        if at is None or len(at) != len(now) or any(a is not b or u != v for (a, u), (b, v) in zip(at, now)):
            self._stacked_buffers = {n: torch.stack([bufs[n] for bufs in members]) for n in members[0]}
            self._buffers_at = now
        buffers = self._stacked_buffers

        def one(weights, bufs, sample):
            with _swapped(first, weights, bufs):
                return first.seed_loss(sample)

        return torch.func.vmap(one)(dict(zip(self.names, self.stacked)), buffers, data)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        prepare_seeds(self.members, optimizer, self.seeds)  # each seed's schedule (its step sizes)
        optimizer.step(closure=optimizer_closure)
        step, trainer = self.global_step + 1, self._trainer
        asked = trainer is not None and trainer.should_stop  # a stop asked before this step (not by a member)
        with torch.no_grad():
            first = self.members[0]
            if first.finishes_seeds:  # e.g. one batched projection of every seed's weights
                first.finish_seeds({name: leaf.detach() for name, leaf in zip(self.names, self.stacked)}, step)
            self.guard.hold_stopped_rows()
            for s in self.live:
                if trainer is not None:
                    trainer.should_stop = False
                self.members[s].finish_step(step)
                if trainer is not None and trainer.should_stop:  # a member's own stop (MRP after capture): its seed
                    self.guard.finish(s, step)
            if trainer is not None:
                trainer.should_stop = asked or not any(self.alive)
                self.guard.after_step(step)  # the step is finished: judged with its weights, never before them

    def on_exception(self, exception: BaseException) -> None:
        self.logs.close()

    def validation_step(self, batch, batch_idx, *args):
        for s, member in enumerate(self.members):
            member.validation_step(batch["seeds"][s], batch_idx, *args)

    def test_step(self, batch, batch_idx, *args):
        for s, member in enumerate(self.members):
            member.test_step(batch["seeds"][s], batch_idx, *args)

    def configure_optimizers(self):
        """The method's optimizer, built by the first member while it holds the stacked leaves."""
        first = self.members[0]
        try:
            _place(first, dict(zip(self.names, self.stacked)))  # Parameters: registered as the member's own
            return first.configure_optimizers()
        finally:
            for name in self.names:
                owner, attr = _owner(first, name)
                del owner._parameters[attr]
            self._bind()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if checkpoint.get("seeds", self.seeds) != self.seeds:
            raise ConfigError("seeds", f"the seeds of the checkpoint, {checkpoint['seeds']}, in that order", self.seeds)
        FeatureLearningModule.on_load_checkpoint(self, checkpoint)
        self.guard.load_state_dict(checkpoint.get("seed_guard") or {})
        for member, own in zip(self.members, checkpoint.get("seed_members") or []):
            member.on_load_checkpoint({**own, "optimizer_states": []})

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The guard's verdicts and what each member adds to a checkpoint of its own (stage clocks...)."""
        checkpoint["seeds"] = self.seeds
        checkpoint["seed_guard"] = self.guard.state_dict()
        checkpoint["seed_members"] = []
        for member in self.members:
            own: dict = {}
            member.on_save_checkpoint(own)
            checkpoint["seed_members"].append(own)

    # --- per-seed logs (featlearn.lightning_modules.seed_logs) -----------------------------------
    def member_log(self, member, name: str, value, **options) -> None:
        """A member's ``self.log`` (Lightning's keyword arguments): its seed's run, as Lightning would write it."""
        self.logs.log(member._seed_row, name, value, **options)

    def member_writer(self, member):
        return self.logs.writer(member._seed_row)

    def member_results(self, member, params: dict, results: dict) -> None:
        self.logs.results(member._seed_row, params, results)

    def heatmaps(self) -> dict[str, torch.Tensor]:
        """The first seed's (in the run's own folder): one frame per seed would cost S figures per frame."""
        return self.members[0].heatmaps()

    @property
    def heatmap_axes(self) -> tuple[str, str]:
        return self.members[0].heatmap_axes

    @property
    def heatmap_scale(self) -> float:
        return self.members[0].heatmap_scale

    def setup(self, stage: str) -> None:
        for member in self.members:  # Lightning attaches the stack only
            member.trainer = self.trainer

    def on_train_start(self) -> None:
        self.guard.start()
        for member in self.members:
            member.on_train_start()

    def on_train_end(self) -> None:
        for member in self.members:
            member.on_train_end()
        self.guard.write_final()

    def on_fit_start(self) -> None:
        for member in self.members:
            member.on_fit_start()

    def on_fit_end(self) -> None:
        for member in self.members:
            member.on_fit_end()
        self.logs.close()

    def on_validation_epoch_end(self) -> None:
        self.logs.end_epoch()           # the steps' values first: a member's epoch end may read them (logged())
        for member in self.members:
            member.on_validation_epoch_end()
        self.logs.end_epoch()           # then what the members logged at their epoch end

    def on_test_epoch_end(self) -> None:
        self.logs.end_epoch()
        for member in self.members:
            member.on_test_epoch_end()
        self.logs.end_epoch()

    def on_train_epoch_end(self) -> None:
        self.logs.end_epoch()

    def final_metrics(self) -> dict[str, float]:
        """The first live seed's results (each seed's are in its own run; :meth:`seed_results` has them all)."""
        return self.members[self.live[0] if self.live else 0].final_metrics()

    def seed_results(self) -> dict[int, dict[str, float]]:
        """Seed -> its ``final_metrics()`` (diverged seeds: from their state before the damage)."""
        return {seed: member.final_metrics() for seed, member in zip(self.seeds, self.members)}


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The submodule holding the dotted parameter ``name``, and its attribute name there."""
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _per_row_hooks(hooks: list[list], grad: torch.Tensor) -> torch.Tensor:
    rows = []
    for g, row_hooks in zip(grad, hooks):
        for hook in row_hooks:
            out = hook(g)
            g = g if out is None else out
        rows.append(g)
    return torch.stack(rows)


def _place(module: torch.nn.Module, weights: dict, buffers: dict | None = None) -> None:
    """Set ``module``'s dotted weights (plain attributes, or parameters when given ``Parameter``s) and buffers."""
    for name, tensor in weights.items():
        setattr(*_owner(module, name), tensor)
    for name, tensor in (buffers or {}).items():
        owner, attr = _owner(module, name)
        owner._buffers[attr] = tensor


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, weights: dict, buffers: dict):
    """``module`` computes with these weights and buffers for the duration."""
    saved = ({n: getattr(*_owner(module, n)) for n in weights}, {n: module.get_buffer(n) for n in buffers})
    try:
        _place(module, weights, buffers)
        yield
    finally:
        _place(module, *saved)
