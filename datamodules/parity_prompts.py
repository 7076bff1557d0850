"""Prompts of sparse-parity in-context learning (Shi 2024, Ch. 5 = Shi, Wei, Xu, Liang, ICML 2024, Section 5.5):
the data of :mod:`featlearn.lightning_modules.icl_parity`.

Each prompt has a task, a pair ``(i, j)`` of distinct features: with probability ``1 - p_T`` a pair of the ``k``
important features (the set S1), with probability ``p_T`` any other pair (S2). Its ``n`` examples and its query
are ``x = G phi`` with an orthonormal ``G`` (drawn from the seed, or the identity) and hidden signs ``phi`` in
``{+1, -1}^d``: the pair's signs ``(phi_i, phi_j)`` are ``(1, 1)``, ``(1, -1)``, ``(-1, 1)``, ``(-1, -1)`` with
probabilities ``1/4 + gamma, 1/4, 1/4, 1/4 - gamma``, the others uniform; the label is ``y = phi_i phi_j``.
Training prompts hold ``N`` examples. Validation and test prompts hold ``eval_examples`` (the chapter's ``M``),
draw their task from ``eval_tasks`` (``important``: S1, the chapter's evaluation; ``less_important``: S2) and flip
each example's label with probability ``eval_flip`` (the query's stays true), as the chapter's language-model
experiments flip in-context labels.

The ground truth: the dictionary ``G`` (:attr:`~SparseParityPromptDataModule.dictionary`; its columns are the
features, :attr:`~SparseParityPromptDataModule.features` its rows) and each prompt's ``task`` and query signs.

Example:
    >>> dm = SparseParityPromptDataModule(d=8, k=2, N=16, eval_tasks="less_important")
    >>> b = dm.batch(torch.arange(4), "val")
    >>> label = b["phi_q"].gather(1, b["task"]).prod(1)  # phi_i phi_j of the query
    >>> tuple(b["X"].shape), bool((b["task"].max(1).values >= 2).all()), bool(torch.equal(label, b["y_q"]))
    ((4, 16, 8), True, True)
"""
from __future__ import annotations

from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.validation import PositiveInt, check_args

_Q_PHI, _Q_PAIR, _Q_TASK, _Q_WHICH, _Q_FLIP = 0, 1, 2, 3, 4  # the random quantities' streams within a split
_G_DICT = 7


def task_sets(d: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S1 [k(k-1), 2], S2 [d(d-1) - k(k-1), 2])``: ordered pairs of distinct features, both important (< k) or not."""
    pairs = torch.tensor([(i, j) for i in range(d) for j in range(d) if i != j])
    inside = (pairs < k).all(1)
    return pairs[inside], pairs[~inside]


class SparseParityPromptDataModule(SyntheticDataModule):
    """Sparse-parity prompts (module docstring).

    Args:
        d: features, a power of two (``2^nu2``; default 8).
        k: important features, a power of two ``2^nu1`` with ``2 <= k <= d`` (default 2).
        gamma: the pair's sign skew, in ``(0, 1/4)`` (default 0.2).
        p_T: the less-important task rate in ``[0, 1/2)`` (default 2e-3; Theorem 5.5.1 needs it below
            ``(1/4 - gamma) / (d(d-1)/2 (1/4 + gamma) + 1/4 - gamma)``, 3.95e-3 at the defaults).
        N: examples per training prompt.
        basis: ``random`` (``G`` drawn from the seed) or ``identity``.
        eval_examples, eval_tasks, eval_flip: the validation and test prompts' examples, task set and label-flip
            probability (module docstring).
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule`.
    """

    def __init__(self, d: PositiveInt = 8, k: PositiveInt = 2, gamma: float = 0.2, p_T: float = 2e-3,
                 N: PositiveInt = 512, basis: Literal["random", "identity"] = "random",
                 eval_examples: PositiveInt | None = None,
                 eval_tasks: Literal["important", "less_important"] = "important", eval_flip: float = 0.0,
                 mode: Literal["fixed", "online"] = "online", batch_size: PositiveInt | None = 256,
                 num_val: PositiveInt = 4096, num_test: PositiveInt = 4096, **synthetic):
        check_args("data", SparseParityPromptDataModule.__init__, locals())
        for name, value, ok in (("d", d, d >= 2 and d & (d - 1) == 0), ("k", k, 2 <= k <= d and k & (k - 1) == 0)):
            if not ok:
                raise ConfigError(f"data.{name}", "a power of two" + (f" in [2, d = {d}]" if name == "k" else " >= 2"), value)
        if not 0 < gamma < 0.25:
            raise ConfigError("data.gamma", "in (0, 1/4)", gamma)
        if not 0 <= p_T < 0.5 or (p_T > 0 and k == d):
            raise ConfigError("data.p_T", "in [0, 1/2) (and 0 when k = d: no less-important pairs)", p_T)
        if not 0 <= eval_flip <= 1:
            raise ConfigError("data.eval_flip", "a probability in [0, 1]", eval_flip)
        if eval_tasks == "less_important" and k == d:
            raise ConfigError("data.eval_tasks", "important when k = d (no less-important pairs)", eval_tasks)
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        self.d, self.k, self.gamma, self.p_T, self.N = d, k, float(gamma), float(p_T), N
        self.M = N if eval_examples is None else eval_examples
        self.eval_tasks, self.eval_flip, self.basis_kind = eval_tasks, float(eval_flip), basis
        self.check_memory({"d": d, "N": N}, train_values=(N + 1) * (d + 1) + 2, eval_values=(self.M + 1) * (d + 1) + 2,
                          out_bytes=4, consts=d * d * 8)
        self.S1, self.S2 = task_sets(d, k)
        if basis == "random":
            self.dictionary = rng.global_orthonormal(self.seed, _G_DICT, d, d)
        else:
            self.dictionary = torch.eye(d, dtype=torch.float64)

    def _tasks(self, index: torch.Tensor, split: str) -> torch.Tensor:
        seed, st = self.seed, self.stream
        S1, S2 = self.S1.to(index.device), self.S2.to(index.device)
        if split != "train" and self.eval_tasks == "less_important":
            return S2[rng.randint(seed, st(split, _Q_TASK), index, (), len(S2))]
        one = S1[rng.randint(seed, st(split, _Q_TASK), index, (), len(S1))]
        if split != "train" or self.p_T == 0:
            return one
        two = S2[rng.randint(seed, st(split, _Q_WHICH), index, (), len(S2))]
        less = rng.uniform(seed, st(split, _Q_WHICH + 10), index) < self.p_T
        return torch.where(less.unsqueeze(-1), two, one)

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """``X [B, n, d]``, ``y [B, n]`` (flipped on val/test with probability ``eval_flip``), ``x_q [B, d]``,
        ``y_q [B]``, the ``task [B, 2]`` and the query's signs ``phi_q [B, d]``; ``n = N`` for training, ``M``
        otherwise."""
        seed, st, g = self.seed, self.stream, self.gamma
        n = self.N if split == "train" else self.M
        task = self._tasks(index, split)
        phi = torch.where(rng.uniform(seed, st(split, _Q_PHI), index, (n + 1, self.d)) < 0.5, 1.0, -1.0)
        u = rng.uniform(seed, st(split, _Q_PAIR), index, (n + 1,))
        # (1, 1), (1, -1), (-1, 1), (-1, -1) with probabilities 1/4 + g, 1/4, 1/4, 1/4 - g
        phi_i = torch.where(u < 0.5 + g, 1.0, -1.0)
        phi_j = torch.where((u < 0.25 + g) | ((u >= 0.5 + g) & (u < 0.75 + g)), 1.0, -1.0)
        i, j = (task[:, c].view(-1, 1, 1).expand(-1, n + 1, 1) for c in (0, 1))
        phi = phi.scatter(2, i, phi_i.unsqueeze(-1)).scatter(2, j, phi_j.unsqueeze(-1))
        y = phi_i * phi_j
        x = phi @ self.dictionary.T.to(phi)
        labels = y[:, :n]
        if split != "train" and self.eval_flip > 0:
            labels = torch.where(rng.uniform(seed, st(split, _Q_FLIP), index, (n,)) < self.eval_flip, -labels, labels)
        return {"X": x[:, :n], "y": labels, "x_q": x[:, n], "y_q": y[:, n], "task": task, "phi_q": phi[:, n]}

    @property
    def features(self) -> torch.Tensor:
        """The dictionary's columns, one feature per row (the first ``k`` are the important ones)."""
        return self.dictionary.T.float()
