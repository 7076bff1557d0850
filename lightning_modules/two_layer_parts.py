"""What the two-layer methods (:mod:`featlearn.lightning_modules.two_layer`) use beside the module: the
optimiser of the schedule's exact steps, the check of its stage-3 decay and the neurons' MDS picture (its
data and its drawing).

Example:
    >>> p = torch.nn.Parameter(torch.tensor([3.0]))
    >>> opt = ScheduledGD([{"params": [p], "name": "w"}])
    >>> p.grad = torch.tensor([2.0]); opt.param_groups[0].update(lr=0.5, decay=0.0); _ = opt.step()
    >>> p.tolist()   # decay 0 erases w exactly: w <- -lr grad
    [-1.0]
"""
from __future__ import annotations

import numpy as np
import torch

from featlearn.errors import ConfigError
from featlearn.metrics.figures import plt
from featlearn.theory.two_layer import centre_coverage, mds_embedding


class ScheduledGD(torch.optim.Optimizer):
    """Plain gradient steps ``p <- decay * p - lr * grad`` per parameter group; the module sets ``lr`` and
    ``decay = 1 - 2 lr lambda`` of every group before each step (the schedule), so ``decay = 0`` erases
    a parameter exactly instead of through the cancellation ``p - lr (grad + p / lr)``."""

    per_row_values = True  # a seed stack's group may hold a tuple per entry: row s of each weight, seed s's value

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0, "decay": 1.0})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["decay"]
            for p in group["params"]:
                if p.grad is None or not p.requires_grad:
                    continue
                if isinstance(lr, tuple) or isinstance(decay, tuple):  # seed s's values on row s, as it alone
                    n = len(p)
                    for row, grad, lr_s, decay_s in zip(p, p.grad, _per_row(lr, n), _per_row(decay, n), strict=True):
                        _update(row, grad, lr_s, decay_s)
                else:
                    _update(p, p.grad, lr, decay)
        return loss


def _per_row(value, n: int) -> tuple:
    return value if isinstance(value, tuple) else (value,) * n


def _update(p: torch.Tensor, grad: torch.Tensor, lr: float, decay: float) -> None:
    if decay == 0:
        torch.mul(grad, -lr, out=p)
    else:
        p.mul_(decay).add_(grad, alpha=-lr)


def check_stage3_decay(theory: dict[str, float], reg3_mult: float) -> None:
    """Refuse a stage-3 step ``theta <- (1 - 2 eta lambda) theta - eta grad`` whose decay is negative (it would
    flip the sign of a or w every step): a large second-layer step (``lr3a_mult``) needs a small ``reg3_mult``."""
    rate = 2 * max(theory["lr3"], theory["lr3a"]) * theory["reg3"]
    if rate > 1:
        raise ConfigError("model.reg3_mult", f"at most {reg3_mult / rate:.3g} with these stage-3 step sizes "
                          f"(lr3_mult, lr3a_mult), so that the decay 1 - 2 eta lambda stays >= 0", reg3_mult)


def neuron_picture(snapshots: dict[str, torch.Tensor], direction: torch.Tensor, centres: torch.Tensor | None,
                   k: int) -> dict:
    """The MDS picture of neuron directions, JSON-able: per snapshot (name: ``[n, d]`` first-layer rows) the
    positions, the colour (cos(w_i, ``direction``), or on the Gaussian mixture, with ``centres``, the best
    centre cosine, with the 2^k centres placed too: y = +1 or not) and a title."""
    panels = []
    for name, w in snapshots.items():
        w = w.double().cpu()
        if centres is not None:
            c = centres.double().cpu()
            xy = mds_embedding(torch.cat([w, c]))
            bits = (torch.arange(len(c))[:, None] >> torch.arange(k)) & 1
            panels.append({"xy": xy[: len(w)].tolist(), "colour": centre_coverage(c, w).tolist(),
                           "centres": xy[len(w):].tolist(), "positive": ((k - bits.sum(1)) % 2 == 0).tolist(),
                           "title": f"{name}: mean coverage {float(centre_coverage(w, c).mean()):.3f}"})
        else:
            v = direction.double().cpu()
            cos = (w @ v) / (w.norm(dim=1) * v.norm()).clamp_min(1e-300)
            panels.append({"xy": mds_embedding(w).tolist(), "colour": cos.tolist(),
                           "title": f"{name}: max cos {float(cos.max()):.3f}"})
    return {"mog": centres is not None, "panels": panels}


def draw_neurons(picture: dict | None):
    """The figure of a :meth:`~featlearn.lightning_modules.two_layer.TwoLayerBase.neuron_picture`: three MDS panels coloured by cos(w_i, sum_A M_j),
    or on the Gaussian mixture by the best centre cosine with the centres drawn among them (red: y = +1,
    orange: y = -1; as Fig. A.12). None for None."""
    if picture is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(12, 4), constrained_layout=True)
    mog = picture["mog"]
    for ax, panel in zip(axes, picture["panels"]):
        xy = np.asarray(panel["xy"])
        if mog:
            image = ax.scatter(xy[:, 0], xy[:, 1], c=panel["colour"], cmap="Blues", vmin=0, vmax=1, s=12)
            centres = np.asarray(panel["centres"])
            ax.scatter(centres[:, 0], centres[:, 1], marker="*", s=90, edgecolors="k", linewidths=0.5,
                       c=["red" if p else "orange" for p in panel["positive"]])
        else:
            image = ax.scatter(xy[:, 0], xy[:, 1], c=panel["colour"], cmap="RdBu_r", vmin=-1, vmax=1, s=12)
        ax.set(title=panel["title"], xlabel="MDS 1", ylabel="MDS 2")
    fig.colorbar(image, ax=axes, label="max_c cos(w_i, centre c)" if mog else "cos(w_i, sum_A M_j)")
    return fig
