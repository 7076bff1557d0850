"""Divergence per seed for a :class:`~featlearn.lightning_modules.seeds.SeedStack`: a seed that diverges stops
alone, keeps the state it had before the damage, and the other seeds go on.

Each step's per-seed numbers (loss, whether it is finite, the weight norm of the seed's rows) are kept on the
device and read in one transfer every ``check_every_n_steps`` steps (the CLI's ``divergence.*`` settings, whose
:class:`~featlearn.callbacks.DivergenceGuard` stands aside for a stack), then judged in order as the guard
judges a run: a non-finite loss or weight, or a watched quantity (the method's ``blowup_factors``) more than its
factor times its smallest value over the last ``window`` steps. A seed below the square root of every factor is
healthy, and its state (rows and the member's buffers) is kept in memory as its snapshot; a seed that diverges
goes back to its snapshot, is held there (its rows are restored after every optimizer step), and the snapshot is
written to ``<log_dir>/seed_<s>/before_divergence.ckpt`` with a message naming the seed, the step, the quantity
and the field to change. A seed whose method asks to stop (``trainer.should_stop``) is held the same way.
"""
from __future__ import annotations

import math
import weakref
from collections import deque
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_warn

from featlearn.errors import DivergenceError
from featlearn.metrics.figures import run_folder

QUANTITIES = ("loss", "weight_norm")
STEP = "__step__"  # a snapshot's entry: the finished step its state is from


class SeedGuard:
    """The per-seed judge of one stack (module docstring); its ``state_dict`` goes into the run's checkpoints."""

    def __init__(self, stack):
        self._stack = weakref.ref(stack)
        self.window, self.every, self.factors = 20, None, dict(stack.members[0].blowup_factors)
        self.scale = getattr(stack.members[0], "weight_norm_scale", None)
        size = len(stack.members)
        self.history = [deque(maxlen=self.window) for _ in range(size)]
        self.snapshots: list[dict | None] = [None] * size
        self.stopped: dict[int, str] = {}      # seed row -> why it stopped ("diverged: ..." or "finished")
        self._losses = None
        self._pending: list[tuple[int, torch.Tensor]] = []

    @property
    def stack(self):
        return self._stack()

    def start(self) -> None:
        """Take the CLI's ``divergence.*`` settings and a first snapshot of every seed."""
        from featlearn.callbacks import DivergenceGuard

        trainer = self.stack.trainer
        cli = next((c for c in trainer.callbacks if isinstance(c, DivergenceGuard)), None)
        if cli is not None:
            self.factors = cli.factors(self.stack.members[0])
            self.every = cli.check_every_n_steps
            if cli.window != self.window:
                self.window = cli.window
                self.history = [deque(h, maxlen=self.window) for h in self.history]
        norms = self._norms()
        for s in self.stack.live:
            if self.snapshots[s] is None:  # a resumed run keeps the snapshots of its checkpoint
                self.snapshots[s] = self._snapshot(s)
            if not self.history[s]:  # the initial weights are the first reference: a first step can blow up too
                self.history[s].append({"loss": 0.0, "weight_norm": float(norms[s])})
        self._pending = []

    def record(self, losses: torch.Tensor) -> None:
        self._losses = losses

    def _norms(self) -> torch.Tensor:
        """Each seed's weight norm ``[S]`` (float64, on the device)."""
        squares = [torch.linalg.vector_norm(leaf.detach().reshape(len(leaf), -1), dim=1, dtype=torch.float64) ** 2
                   for leaf in self.stack.stacked]
        return torch.stack(squares).sum(0).sqrt()

    def after_step(self, step: int) -> None:
        """Keep finished step ``step``'s numbers (its loss, its weights after the update and the step's finishing
        work); read and judge the kept steps every ``check_every_n_steps`` steps."""
        stack = self.stack
        if self._losses is None:
            return
        losses = self._losses.to(torch.float64)
        self._pending.append((step, torch.stack([losses.abs(), (~torch.isfinite(losses)).to(torch.float64),
                                                 self._norms()])))
        self._losses = None
        every = self.every or max(1, stack.trainer.log_every_n_steps)
        if step % every == 0 or stack.trainer.should_stop:
            self.check()

    def check(self) -> None:
        """Judge the kept steps (one host transfer); stop the seeds that diverged."""
        if not self._pending:
            return
        stack, pending, self._pending = self.stack, self._pending, []
        kept = torch.stack([t for _, t in pending])                     # [steps, 3, S]
        trainer = stack._trainer
        if trainer is not None and trainer.world_size > 1:  # one verdict on every process: the worst of them
            kept = trainer.strategy.reduce(kept, reduce_op="max")
        rows = kept.cpu().tolist()
        healthy = set(stack.live)
        for (step, _), (loss, broken, norm) in zip(pending, rows):
            for s in sorted(healthy):
                reason = self._judge(s, step, {"loss": loss[s], "weight_norm": norm[s]}, broken[s] == 0.0)
                if reason is not None:
                    healthy.discard(s)
                    self._stop(s, step, reason)
        for s in healthy:
            if not self._suspect(s):
                self.snapshots[s] = self._snapshot(s, pending[-1][0])
        if trainer is not None and not any(stack.alive):
            trainer.should_stop = True
        if not any(stack.alive) and self.stopped and all(r.startswith("diverged") for r in self.stopped.values()):
            raise DivergenceError("every seed diverged: " + "; ".join(
                f"seed {stack.seeds[s]} {r.removeprefix('diverged: ')}" for s, r in sorted(self.stopped.items())))

    def _judge(self, s: int, step: int, now: dict, loss_finite: bool) -> str | None:
        if not loss_finite:
            return f"train loss is not finite at step {step}"
        if not math.isfinite(now["weight_norm"]):
            return f"its weights are not finite at step {step}"
        for quantity, factor in self.factors.items():
            past = [h[quantity] for h in self.history[s]]
            floor = self.scale if quantity == "weight_norm" else None
            smallest = min(past) if past else None
            if smallest is not None and floor is not None and smallest < floor:
                smallest = floor
            if factor is not None and smallest and now[quantity] > factor * smallest:
                return (f"{quantity} grew from {smallest:.4g} to {now[quantity]:.4g} (over {factor:g}x) by step "
                        f"{step}")
        self.history[s].append(now)
        return None

    def _suspect(self, s: int) -> bool:
        if not self.history[s]:
            return False
        last = self.history[s][-1]
        for quantity, factor in self.factors.items():
            past = [h[quantity] for h in self.history[s]]
            if factor is not None and min(past) > 0 and last[quantity] > math.sqrt(factor) * min(past):
                return True
        return False

    # --- stopping and holding a seed ---------------------------------------------------------
    def _snapshot(self, s: int, step: int | None = None) -> dict:
        """Seed row ``s``'s state now (its rows and its member's buffers), after finished step ``step``."""
        stack, member = self.stack, self.stack.members[s]
        state = {name: leaf.detach()[s].clone() for name, leaf in zip(stack.names, stack.stacked)}
        state.update({k: v.detach().clone() for k, v in member.state_dict().items()})
        state[STEP] = torch.tensor(stack.global_step if step is None else step)
        return state

    def _restore(self, s: int) -> None:
        stack, snap = self.stack, self.snapshots[s]
        with torch.no_grad():
            for name, leaf in zip(stack.names, stack.stacked):
                leaf[s] = snap[name]
            own = {k: v for k, v in snap.items() if k not in stack.names and k != STEP}
            stack.members[s].load_state_dict(own, strict=False)

    def _stop(self, s: int, step: int, reason: str) -> None:
        stack = self.stack
        stack.alive[s] = False
        self.stopped[s] = f"diverged: {reason}"
        self._restore(s)
        path = self.write(s, "before_divergence.ckpt")
        kept_at = int(self.snapshots[s][STEP])
        fields = " or ".join(f"--model.init_args.{f}" for f in stack.members[s].step_size_fields)
        seed = stack.seeds[s]
        rank_zero_warn(f"seed {seed} diverged ({reason}) and stops here; the other seeds go on. Its state after step "
                       f"{kept_at}, before the damage, is {path}: resume that seed alone with a smaller "
                       f"{fields}: lightning fit --config CONFIG --seed_everything {seed} --data.init_args.seed {seed} "
                       f"--ckpt_path {path or '...'} (and --model.init_args.seed {seed} where the model takes one).")

    def finish(self, s: int, step: int) -> None:
        """Seed row ``s`` asked to stop after step ``step`` (its method's own stopping rule): hold it there."""
        self.stack.alive[s] = False
        self.stopped[s] = "finished"
        self.snapshots[s] = self._snapshot(s, step)

    def hold_stopped_rows(self) -> None:
        """Undo the optimizer's update of stopped seeds (momentum, Adam state or weight decay still move them)."""
        stack = self.stack
        for s, ok in enumerate(stack.alive):
            if not ok:
                for name, leaf in zip(stack.names, stack.stacked):
                    leaf.detach()[s] = self.snapshots[s][name]

    # --- files -----------------------------------------------------------------------------
    def write(self, s: int, filename: str, state: dict | None = None, fresh_optimizer: bool = True) -> str | None:
        """Seed row ``s`` as a training checkpoint of its method alone, ``<log_dir>/seed_<seed>/filename`` (rank
        0): ``lightning fit --ckpt_path`` resumes it as a run of that seed (the optimizer's state is the seed's
        rows, or fresh with ``fresh_optimizer``: after a divergence it is not worth keeping)."""
        stack = self.stack
        trainer = stack._trainer
        if trainer is None or trainer.global_rank != 0:
            return None
        member, data = stack.members[s], trainer.datamodule
        folder = Path(run_folder(trainer)) / f"seed_{stack.seeds[s]}"
        folder.mkdir(parents=True, exist_ok=True)
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in ("seeds", "seed_guard", "seed_members", "callbacks", type(data).__qualname__):
            ckpt.pop(key, None)
        member.on_save_checkpoint(ckpt)
        member_data = data.members[s]
        ckpt[type(member_data).__qualname__] = member_data.state_dict()
        state = self.snapshots[s] if state is None else state
        ckpt["state_dict"] = {k: v.detach().cpu().clone() for k, v in state.items() if k != STEP}
        # the step the weights are from (the loops' counters are the stack's, at the write)
        ckpt["weights_step"] = int(state[STEP])
        kind = type(member)
        ckpt["hyper_parameters"] = {**dict(member.hparams_initial),
                                    "_class_path": f"{kind.__module__}.{kind.__qualname__}"}
        ckpt["optimizer_states"] = [_rows(o, s, len(stack.members), fresh_optimizer)
                                    for o in ckpt.get("optimizer_states", [])]
        ckpt["seed"] = stack.seeds[s]
        torch.save(ckpt, folder / filename)
        return str(folder / filename)

    def write_final(self) -> None:
        """Each seed that did not diverge: its final state as ``seed_<s>/last.ckpt``."""
        self.check()
        for s in range(len(self.stack.members)):
            if not self.stopped.get(s, "").startswith("diverged"):
                self.write(s, "last.ckpt", self._snapshot(s), fresh_optimizer=False)

    def state_dict(self) -> dict:
        return {"alive": list(self.stack.alive), "stopped": dict(self.stopped), "snapshots": self.snapshots,
                "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.stack.alive[:] = state["alive"]
        self.stopped = dict(state["stopped"])
        self.snapshots = list(state["snapshots"])
        self.history = [deque(h, maxlen=self.window) for h in state.get("history", [[] for _ in self.history])]


def _rows(optimizer_state: dict, s: int, size: int, fresh: bool) -> dict:
    """One seed's optimizer state: row ``s`` of every per-parameter tensor of the stacked optimizer (the step
    counters are shared); no state at all with ``fresh``."""
    groups = optimizer_state["param_groups"]
    if fresh:
        return {"state": {}, "param_groups": groups}
    rows = {}
    for index, entries in optimizer_state["state"].items():
        rows[index] = {k: v[s].clone() if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == size else v
                       for k, v in entries.items()}
    return {"state": rows, "param_groups": groups}
