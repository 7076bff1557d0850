"""The hidden-representation linear multi-task model of the universality / label-efficiency trade-off
(Shi 2024, Ch. 7, Eq. 7.6-7.8, sampled: the dissertation itself runs no synthetic experiment).

Latent ``z = [z_S; z_{P_1}; ...; z_{P_T}; z_U]`` in ``R^d``, ``d = k + u``, ``k = s + T (r - s)``:

* ``S``: ``s`` shared features, ``z_S ~ N(0, sigma_S^2 I)`` in every task;
* ``P_t``: ``r - s`` private features of task ``t``, ``z_{P_t} ~ N(0, sigma_R^2 I)`` in task ``t`` and 0 in the
  others;
* ``U``: ``u`` spurious features, ``z_U ~ N(0, sigma_U^2 I)``, **resampled in the positive view**:
  ``z^+ = [z_R; z_U^+]`` with ``z_U^+`` independent of ``z_U``.

Inputs ``x = M z`` with an orthonormal dictionary ``M [d, d]`` (``"haar"``: the Q factor of a Gaussian matrix,
signs fixed; ``"identity"`` for debugging). A training (pretraining) sample draws its task from the mixture
``w`` (``task_weights``, uniform by default) restricted to the tasks the module pretrains on
(:meth:`HiddenRepresentationDataModule.use_tasks`), and holds ``x``, ``x_pos`` and ``task``; negatives are the
other samples of the batch.

Labels of task ``t``: ``y = <u_t*, z_{R_t}> + label_noise * eps`` (``label="sign"``: the sign of it), with
``u_t*`` drawn once per task and rescaled so that ``v_{t,1} = ||u*_{t,S}||^2 = 1/2`` and
``v_{t,2} = ||u*_{t,P_t}||^2 = 1/2`` (the dissertation's example). The validation split holds the ``num_val``
labelled samples of ``target_task`` (``m``, the downstream training set) and the test split ``num_test``
test samples of it; :meth:`HiddenRepresentationDataModule.labeled` gives labelled samples of any task
(sample ``i`` of task ``t`` is a function of ``(seed, split, t, i)``, so the first ``m`` of a larger draw are
a draw of ``m``: the label sets of an ``m`` sweep are nested).

Example:
    >>> dm = HiddenRepresentationDataModule(T=2, s=2, r=3, u=1, dictionary="identity", batch_size=4)
    >>> b = dm.sample(torch.arange(4), "train")
    >>> bool((b["x"][:, :4] == b["x_pos"][:, :4]).all()), bool((b["x"][:, 4] != b["x_pos"][:, 4]).all())
    (True, True)
    >>> dm.k, dm.d, dm.groups["P"][1].tolist()
    (4, 5, [3])
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule, matmul_per_seed
from featlearn.errors import ConfigError
from featlearn.theory.universality import layout
from featlearn.validation import (NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_args,
                                  int_at_least)

# per-split quantities (RNG streams via SyntheticDataModule.stream(split, q))
_Q_TASK, _Q_S, _Q_P, _Q_U, _Q_U_POS, _Q_NOISE = 1, 2, 3, 4, 5, 6
# global quantities
_G_DICT, _G_LABEL = 11, 12


class HiddenRepresentationDataModule(SyntheticDataModule):
    """The linear multi-task model of Shi 2024, Eq. 7.6-7.8; see the module docstring.

    Args:
        T: number of tasks, at least 2 (the metrics compare the target task with another one). s: shared
            features. r: invariant features per task (``r > s``: ``r - s`` private features each). u: spurious
            features (resampled in the positive view).
        sigma_S, sigma_R, sigma_U: standard deviations of the shared, private and spurious coordinates.
        task_weights: mixture weights ``w_t`` (``T`` positive numbers, normalised; ``None``: uniform).
        dictionary: ``"haar"`` (random orthonormal ``M``) or ``"identity"``.
        target_task: the task of the validation / test splits and of task-specific pretraining.
        label: ``"regression"`` (``y = <u*, z> + noise``) or ``"sign"`` (its sign).
        label_noise: standard deviation of the noise added to ``<u*, z>``.
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule` (``num_val``: ``m``, the labelled samples
            of the target task).
    """

    def __init__(
        self,
        T: int_at_least(2) = 4,
        s: PositiveInt = 5,
        r: PositiveInt = 10,
        u: NonNegativeInt = 10,
        sigma_S: PositiveFloat = 1.0,
        sigma_R: PositiveFloat = 1.0,
        sigma_U: PositiveFloat = 1.0,
        task_weights: list[PositiveFloat] | None = None,
        dictionary: Literal["haar", "identity"] = "haar",
        target_task: NonNegativeInt = 0,
        label: Literal["regression", "sign"] = "regression",
        label_noise: NonNegativeFloat = 0.0,
        # SyntheticDataModule's arguments whose defaults differ here; the others pass through **synthetic
        mode: Literal["fixed", "online"] = "online", batch_size: PositiveInt | None = 1024,
        num_val: PositiveInt = 100, num_test: PositiveInt = 4000, **synthetic,
    ):
        check_args("data", HiddenRepresentationDataModule.__init__, locals())
        if r <= s:
            raise ConfigError("data.r", f"an integer > s = {s} (each task needs private features)", r)
        if target_task >= T:
            raise ConfigError("data.target_task", f"a task index in [0, T) = [0, {T})", target_task)
        if task_weights is not None and len(task_weights) != T:
            raise ConfigError("data.task_weights", f"a list of T = {T} positive weights, or null", task_weights)
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        self.groups = layout(T, s, r, u)
        self.T, self.s, self.r, self.u = T, s, r, u
        self.k, self.d = self.groups["k"], self.groups["d"]
        self.sigma_S, self.sigma_R, self.sigma_U = float(sigma_S), float(sigma_R), float(sigma_U)
        total = sum(task_weights) if task_weights is not None else float(T)
        self.task_weights = [float(w) / total for w in task_weights] if task_weights is not None else [1.0 / T] * T
        self.dictionary, self.target_task, self.label, self.label_noise = dictionary, target_task, label, label_noise
        d = self.d
        # a training sample holds x, x_pos and the latents behind them; an evaluation sample x, z and y
        self.check_memory({"T": T, "s": s, "r": r, "u": u}, train_values=4 * d, eval_values=2 * d + 2, out_bytes=4,
                          consts=24 * d * d)
        self.tasks = list(range(T))
        self._consts: dict[str, dict[str, torch.Tensor]] = {}
        self._task_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------
    # what the module chooses
    # ------------------------------------------------------------------------------------------
    def use_tasks(self, tasks: list[int] | None) -> None:
        """Pretrain on these tasks only (their mixture weights renormalised); ``None``: every task. Called by
        the module's ``build`` (universal: all; specific and contrastive regularisation: the target)."""
        tasks = list(range(self.T)) if tasks is None else sorted(set(int(t) for t in tasks))
        if not tasks or tasks[0] < 0 or tasks[-1] >= self.T:
            raise ConfigError("tasks", f"task indices in [0, T) = [0, {self.T})", tasks)
        self.tasks = tasks
        self._task_tables = {}

    # ------------------------------------------------------------------------------------------
    # global quantities
    # ------------------------------------------------------------------------------------------
    def _build_consts(self) -> dict[str, torch.Tensor]:
        d, zero = self.d, torch.zeros((), dtype=torch.int64)
        if self.dictionary == "haar":
            M = rng.global_orthonormal(self.seed, _G_DICT, d, d)
        else:
            M = torch.eye(d, dtype=torch.float64)
        raw = rng.normal(self.seed, _G_LABEL, zero, (self.T, self.r), torch.float64)
        s = self.s
        # u_t* on (S, P_t), one draw per task, each part rescaled to squared norm 1/2 (v_{t,1} = v_{t,2} = 1/2)
        parts = [raw[:, :s], raw[:, s:]]
        label_vectors = torch.cat([q / q.norm(dim=1, keepdim=True) * math.sqrt(0.5) for q in parts], 1)
        return {"M": M, "label_vectors": label_vectors}

    def _const(self, name: str, device, dtype=torch.float32) -> torch.Tensor:
        key = f"{torch.device(device)}:{dtype}"
        if key not in self._consts:
            if "cpu64" not in self._consts:
                self._consts["cpu64"] = self._build_consts()
            self._consts[key] = {k: v.to(device=device, dtype=dtype) for k, v in self._consts["cpu64"].items()}
        return self._consts[key][name]

    @property
    def M(self) -> torch.Tensor:
        """The dictionary ``[d, d]`` (orthonormal, float64, CPU): ``x = M z``."""
        return self._const("M", "cpu", torch.float64)

    @property
    def label_vectors(self) -> torch.Tensor:
        """``u_t*`` on ``(S, P_t)`` for each task ``[T, r]`` (float64): ``||u*_S||^2 = ||u*_{P_t}||^2 = 1/2``, drawn
        independently per task."""
        return self._const("label_vectors", "cpu", torch.float64)

    @property
    def features(self) -> torch.Tensor:
        """The latent feature directions, one per row: ``M^T`` ``[d, d]`` (rows ordered S, P_1..P_T, U)."""
        return self.M.t()

    # ------------------------------------------------------------------------------------------
    # sampling
    # ------------------------------------------------------------------------------------------
    def _latents(self, index: torch.Tensor, split: str, task: torch.Tensor, seed=None) -> torch.Tensor:
        """``z [n, d]`` with task ``task[i]`` for sample ``i`` (spurious part included); ``[S, n, d]`` for a tensor
        of seeds (``task [S, n]``)."""
        seed = self.seed if seed is None else seed
        dev, st, p = index.device, self.stream, self.r - self.s
        shared = self.sigma_S * rng.normal(seed, st(split, _Q_S), index, (self.s,))
        z = shared.new_zeros(*shared.shape[:-1], self.d)
        z[..., :self.s] = shared
        cols = self.s + task.unsqueeze(-1) * p + torch.arange(p, device=dev)
        z.scatter_(-1, cols, self.sigma_R * rng.normal(seed, st(split, _Q_P), index, (p,)))
        if self.u:
            z[..., self.k:] = self.sigma_U * rng.normal(seed, st(split, _Q_U), index, (self.u,))
        return z

    def _tasks(self, index: torch.Tensor, split: str, seed) -> torch.Tensor:
        if index.device not in self._task_tables:  # the mixture's bin edges and task ids, once per device
            weights = torch.tensor([self.task_weights[t] for t in self.tasks], dtype=torch.float64)
            self._task_tables[index.device] = (torch.cumsum(weights / weights.sum(), 0)[:-1].to(index.device),
                                               torch.tensor(self.tasks, device=index.device))
        edges, tasks = self._task_tables[index.device]
        draw = rng.uniform(seed, self.stream(split, _Q_TASK), index, (), torch.float64)
        return tasks[torch.bucketize(draw, edges, right=True)]

    def _pairs(self, index: torch.Tensor, split: str, seed, Mt) -> dict[str, torch.Tensor]:
        """Pretraining pairs of one seed (``Mt = M^T``) or of a tensor of seeds (``Mt``: a list, one per seed)."""
        task = self._tasks(index, split, seed)
        z = self._latents(index, split, task, seed)
        x = matmul_per_seed(z, Mt)
        if self.u:
            z[..., self.k:] = self.sigma_U * rng.normal(seed, self.stream(split, _Q_U_POS), index, (self.u,))
        return {"x": x, "x_pos": matmul_per_seed(z, Mt), "task": task}

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """Training: pretraining pairs ``x, x_pos, task`` from the mixture; validation / test: labelled
        samples of the target task (:meth:`labeled`)."""
        if split != "train":
            return self.labeled(self.target_task, index, split)
        return self._pairs(index, split, self.seed, self._const("M", index.device).mT)

    def sample_seeds(self, members: list, index: torch.Tensor, split: str) -> dict[str, torch.Tensor] | None:
        """The training pairs of every member in one draw (the products seed by seed, with each one's dictionary)."""
        if split != "train":
            return None
        seeds = self.seeds_of(members, index.device)
        return self._pairs(index, split, seeds, [m._const("M", index.device).mT for m in members])

    def labeled(self, task: int, index: torch.Tensor, split: Literal["val", "test"] = "val") -> dict[str, torch.Tensor]:
        """Labelled samples of ``task``: ``x``, ``z``, ``y`` (float32) and ``task``. Sample ``i`` of task ``t`` is a
        function of ``(seed, split, t, i)`` (the task is folded into the high word of the RNG index).

        Example:
            >>> dm = HiddenRepresentationDataModule(T=3, label_noise=0.0)
            >>> a = dm.labeled(2, torch.arange(10)); b = dm.labeled(2, torch.arange(4))
            >>> bool(torch.equal(a["y"][:4], b["y"]))
            True
        """
        if not 0 <= task < self.T:
            raise ConfigError("task", f"a task index in [0, T) = [0, {self.T})", task)
        if split not in ("val", "test"):
            raise ConfigError("split", "'val' (labelled training sets) or 'test'", split)
        key = index.to(torch.int64) + (int(task) << 32)
        t = torch.full_like(index, int(task), dtype=torch.int64)
        z = self._latents(key, split, t)
        uvec = self._const("label_vectors", index.device)[task]
        y = z[:, :self.s] @ uvec[:self.s] + z[:, self.groups["P"][task].to(index.device)] @ uvec[self.s:]
        if self.label_noise:
            y = y + self.label_noise * rng.normal(self.seed, self.stream(split, _Q_NOISE), key, ())
        if self.label == "sign":
            y = torch.where(y >= 0, 1.0, -1.0)
        return {"x": z @ self._const("M", index.device).t(), "z": z, "y": y, "task": t}
