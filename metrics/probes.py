"""Linear probes of a representation, shared by every method: closed-form ridge regression and
L2-regularised logistic regression, both on standardised features with an intercept.

Both fit on one split and score on another, in float64. (Not torchmetrics: its R2Score normalises by the
biased variance, ``1 - R2 = nMSE n/(n-1)``, and its accuracy is float32; either would move the tables' numbers.) They work under ``torch.inference_mode`` (Lightning's
validation and test loops): the logistic fit leaves it to run autograd on copies of the inputs.

The probes need whole splits, while Lightning's evaluation loops hand a module batches (under DDP, a share of
them per rank): :class:`SplitBuffer` keeps the batches and gives back the whole split in sample order.

Example:
    >>> x = torch.randn(200, 3); y = x @ torch.tensor([1.0, -2.0, 0.5])
    >>> ridge_probe(x[:100], y[:100], x[100:], y[100:]) < 1e-6
    True
    >>> logistic_probe(x[:100], torch.sign(y[:100]), x[100:], torch.sign(y[100:])) > 0.9
    True
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ridge_probe", "logistic_probe", "SplitBuffer", "all_gather_cat"]


def _design(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both splits standardised with the training split's mean and standard deviation (float64)."""
    train, test = train.double(), test.double()
    mean = train.mean(0)
    std = train.std(0).clamp_min(1e-12)
    return (train - mean) / std, (test - mean) / std


def ridge_probe(f_train: torch.Tensor, y_train: torch.Tensor, f_test: torch.Tensor, y_test: torch.Tensor,
                ridge: float = 1e-4) -> float:
    """Test nMSE ``MSE / Var(y)`` of closed-form ridge regression (intercept, standardised features).

    ``ridge`` is relative to the mean eigenvalue of the (standardised) Gram matrix per sample.
    """
    xtr, xte = _design(f_train, f_test)
    ytr, yte = y_train.double(), y_test.double()
    ymean = ytr.mean()
    gram = xtr.t() @ xtr
    lam = ridge * len(xtr)
    beta = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xtr.t() @ (ytr - ymean))
    pred = xte @ beta + ymean
    return float(((yte - pred) ** 2).mean() / yte.var().clamp_min(1e-24))


def logistic_probe(f_train: torch.Tensor, y_train: torch.Tensor, f_test: torch.Tensor, y_test: torch.Tensor,
                   l2: float = 1e-4, max_iter: int = 100) -> float:
    """Test accuracy of L2-regularised logistic regression (LBFGS) on labels in {-1, +1}; 0-labels dropped."""
    with torch.inference_mode(False), torch.enable_grad():
        # clones: tensors made under inference mode cannot take part in autograd
        keep_tr, keep_te = y_train != 0, y_test != 0
        xtr, xte = _design(f_train[keep_tr].clone(), f_test[keep_te].clone())
        ytr, yte = (y_train[keep_tr] > 0).double(), y_test[keep_te] > 0
        w = torch.zeros(xtr.shape[1], dtype=torch.float64, device=xtr.device, requires_grad=True)
        b = torch.zeros((), dtype=torch.float64, device=xtr.device, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(xtr @ w + b, ytr) + 0.5 * l2 * (w * w).sum()
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            return float(((xte @ w + b > 0) == yte).double().mean())


class SplitBuffer:
    """The batches of evaluation splits (the ``keys`` of each, plus ``index``), given back whole.

    Example:
        >>> buf = SplitBuffer(("x",))
        >>> for idx in ([2, 3], [0, 1]):
        ...     buf.add("val", {"index": torch.tensor(idx), "x": torch.tensor(idx) * 10.0, "other": 0})
        >>> buf.take("val")["x"].tolist()
        [0.0, 10.0, 20.0, 30.0]
    """

    def __init__(self, keys: tuple[str, ...]):
        self.keys = tuple(keys)
        self._parts: dict[str, list[dict]] = {}

    def add(self, split: str, batch: dict) -> None:
        self._parts.setdefault(split, []).append({k: batch[k] for k in ("index", *self.keys)})

    def take(self, split: str) -> dict[str, torch.Tensor]:
        """The split whole and in sample order, and forgotten here. Under DDP every rank saw a share of it (dealt
        round-robin by Lightning's distributed sampler, the last round padded with repeats): gathered from all."""
        parts = self._parts.pop(split)
        data = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        if dist.is_available() and dist.is_initialized():
            data = {k: all_gather_cat(v) for k, v in data.items()}
        index, order = torch.sort(data["index"], stable=True)
        first = torch.cat([index.new_ones(1, dtype=torch.bool), index[1:] != index[:-1]])
        return {k: data[k][order][first] for k in self.keys}


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0 in rank order, without autograd.

    Plain ``torch.distributed.all_gather`` (gloo and NCCL alike): Lightning's ``all_gather`` goes through
    the deprecated differentiable collective even when no gradient is wanted.
    """
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


class _GatherWithGrad(torch.autograd.Function):
    """All ranks' rows in rank order; the backward hands each rank the summed gradient of its own rows."""

    @staticmethod
    def forward(ctx, t):
        ctx.rows = t.shape[0]
        return all_gather_cat(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank's loss may read every rank's rows
        start = dist.get_rank() * ctx.rows
        return grad[start:start + ctx.rows]


def all_gather_cat_with_grad(t: torch.Tensor) -> torch.Tensor:
    """:func:`all_gather_cat` through autograd (``t`` itself on one process): a loss that reads the global
    batch (its mean, other samples as negatives) gets the gradient one process would, once DDP has averaged
    the ranks' parameter gradients. Every rank must hold the same number of rows."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    return _GatherWithGrad.apply(t)
