"""The methods of ``featlearn bench step``: how featlearn builds each method at its main job's size, and the
plain PyTorch loop written from the method's definition (the paper's equations and the config's choices)
that its step is checked and timed against.

A :class:`Method` is one method's step: the DataModule and LightningModule featlearn runs (with the
arguments of the main job's config), and the plain loop: :meth:`Method.state` copies the module's initial
trained tensors and the constants the method's step reads, ``_forward`` is the loss in ~10-20 lines (one GEMM
per branch, the stop-gradient branch from the same product where the method allows; this is what
``torch.compile`` compiles), and :meth:`Method.update` is SGD by hand plus the method's step-finishing work
(a norm cap, a bias schedule, a head's frozen diagonal, a projection). The harness that checks and times
them is :mod:`featlearn.bench.steps`.

Where featlearn's step has a detail the paper leaves open, the plain loop follows featlearn (said in the
method's docstring): the float64 check compares weights after one step to 1e-10.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from featlearn.datamodules.global_local_patches import GlobalLocalPatchDataModule
from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.datamodules.structured_parity import StructuredParityDataModule
from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.experiments.study import Run
from featlearn.kernels import smoothed_relu
from featlearn.lightning_modules.contrastive import ContrastiveModule
from featlearn.lightning_modules.mrp import TeacherStudentMRP
from featlearn.lightning_modules.noncontrastive import NonContrastiveModule
from featlearn.lightning_modules.two_layer import TwoLayerNetwork
from featlearn.lightning_modules.universality import LinearContrastive
from featlearn.lightning_modules.vit_cl import ViTCL
from featlearn.lightning_modules.vit_mae import ViTMAE
from featlearn.theory.contrastive import grown_bias
from featlearn.theory.noncontrastive import population_loss

METHODS = ("mrp", "contrastive", "noncontrastive", "vit_mae", "vit_cl", "two_layer", "universality")
SIZES = ("smoke", "tiny")


@dataclass
class Method:
    """One method's step: how featlearn builds it and the plain loop written from its spec."""
    name: str
    dtype: torch.dtype
    log_every: int
    data: type
    data_args: dict
    model: type
    model_args: dict
    trained: tuple[str, ...]
    """The module's trained tensors, in the order the plain loop returns them."""
    weights = ("w",)
    """The plain loop's trained tensors (keys of its state), in the order of ``trained``."""
    shape_keys = ("k", "d", "P", "num_pretrain", "d1", "batch_size", "num_negatives", "dim", "num_patches",
                  "num_train")
    """The data and model arguments printed as the case's shape."""

    def build(self, seed: int, dtype: torch.dtype, device: torch.device):
        torch.manual_seed(seed)
        dm = self.data(**{**self.data_args, "seed": seed})
        model = self.model(**self.model_args).attach(dm).to(device=device, dtype=dtype)
        return model, dm

    def first_batch(self, dm, device: torch.device, dtype: torch.dtype) -> dict:
        """The first training batch the Trainer would make (step 0, one device)."""
        n = dm.batch_size or dm.sizes["train"]
        batch = dm.batch(torch.arange(n, device=device), "train")
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}

    def shape(self) -> str:
        args = {**self.data_args, **self.model_args}
        return ", ".join(f"{k}={args[k]}" for k in self.shape_keys if args.get(k) is not None)

    def state(self, model) -> dict:
        """The plain loop's state: copies of the trained tensors and the constants the method's step reads."""
        raise NotImplementedError

    def loss(self, state: dict, batch: dict, forward=None) -> torch.Tensor:
        raise NotImplementedError

    def update(self, state: dict, step: int) -> None:
        """SGD on ``state`` from its gradients, then the method's step-finishing work."""
        raise NotImplementedError


def _trainable(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _sgd(params: list[torch.Tensor], lrs: list[float], decay: float = 0.0) -> None:
    for p, lr in zip(params, lrs):
        p.sub_(lr * (p.grad + decay * p))
        p.grad = None


# ------------------------------------------------------------------------------------------------
# Pan et al. 2023: teacher-student MRP, mask-expected loss, full batch, norm cap (Sec. 3.2; the cap is ours)
# ------------------------------------------------------------------------------------------------
class MRP(Method):
    def state(self, model):
        tau = 1 + (1 - model.theta) / (model.C_p * model.theta)  # c_tau = 0: constant teacher scale
        return {"w": _trainable(model.weight), "tau": tau, "theta": model.theta,
                "q": model.q, "rho": model.rho, "lr": model.lr, "cap": model.norm_cap}

    @staticmethod
    def _forward(w, x, tau: float, theta: float, q: int, rho: float):
        def f(a):
            return smoothed_relu(a, q, rho)

        a = x @ w.T  # [N, P, R]: the one GEMM; the teacher tau w reads the same product
        y = f(a)
        teacher = f(tau * a.detach()).sum(1)
        return 0.5 * ((teacher - y.sum(1)) ** 2).sum(1).mean() + 0.5 * (1 / theta - 1) * (y * y).sum((1, 2)).mean()

    def loss(self, state, batch, forward=None):
        return (forward or self._forward)(state["w"], batch["x"], state["tau"], state["theta"], state["q"],
                                          state["rho"])

    @staticmethod
    def _update(w, lr: float, cap: float):
        w.sub_(lr * w.grad)
        w.mul_((cap / w.norm(dim=1, keepdim=True)).clamp(max=1.0))

    def update(self, state, step):
        self._update(state["w"], state["lr"], state["cap"])
        state["w"].grad = None


# ------------------------------------------------------------------------------------------------
# Wen & Li 2021: soft-threshold network, stop-gradient InfoNCE, SGD + weight decay, bias schedule (Sec. 2.2)
# ------------------------------------------------------------------------------------------------
class Contrastive(Method):
    def state(self, model):
        return {"w": _trainable(model.w), "b": model.bias.detach().clone(),
                "M": model.M, "tau": model.tau, "lr": model.hparams.lr, "lam": model.lam, "d": model.d,
                "beta0": model.hparams.bias_reset_mult, "c_b": model.hparams.bias_min_rate_mult, "kappa": model.kappa_b,
                "T1": None}

    @staticmethod
    def _forward(w, b, xa, xq, xn, tau: float):
        def f(x):
            u = x @ w.T
            return torch.relu(u - b) - torch.relu(-u - b)

        ha = f(xa)
        with torch.no_grad():
            hq, hn = f(xq), f(xn)
        logits = torch.cat([(ha * hq).sum(-1, keepdim=True), ha @ hn.T], -1) / tau
        target = torch.zeros(len(ha), dtype=torch.long, device=ha.device)
        return tau * F.cross_entropy(logits, target)

    def loss(self, state, batch, forward=None):
        return (forward or self._forward)(state["w"], state["b"], batch["x_a"], batch["x_q"], batch["x_neg"],
                                          state["tau"])

    @staticmethod
    def _update(w, lr: float, lam: float, M):
        w.sub_(lr * (w.grad + lam * w))
        norm = w.norm(dim=1)
        return norm, ((w @ M) ** 2).sum(1) / norm ** 2

    def update(self, state, step):
        w = state["w"]
        with torch.no_grad():
            prev = w.norm(dim=1)
            norm, rho = self._update(w, state["lr"], state["lam"], state["M"])
            w.grad = None
            d = state["d"]
            if state["T1"] is None and float(rho.min()) >= 0.5:  # T1: reset the bias
                state["T1"] = step
                state["b"] = state["beta0"] * math.sqrt(2 * math.log(d) / d) * norm
            elif state["T1"] is not None:
                state["b"] = grown_bias(state["b"], norm, prev, state["c_b"] * state["lr"] / d, state["kappa"])


# ------------------------------------------------------------------------------------------------
# Wen & Li 2022: cubic patch encoder, identity-initialised head with frozen diagonal, BN cosine loss (eq. 3.3)
# ------------------------------------------------------------------------------------------------
class NonContrastive(Method):
    weights = ("w", "E")

    def state(self, model):
        return {"w": _trainable(model.w), "E": _trainable(model.head), "lr": model.lr, "head_lr": model.head_lr,
                "pop": (model.features, model.alphas, model.probs, model.num_patches, model.num_feature_patches,
                        model.noise_std) if model.gradient == "population" else None}

    @staticmethod
    def _forward(w, E, x, m1):
        a3 = (x @ w.T) ** 3  # [N, P, m]: one GEMM; the stop-gradient view 2 reads the same product
        f = (a3 * m1[..., None]).sum(1)
        g = (a3.detach() * (1 - m1)[..., None]).sum(1)

        def bn(t):
            c = t - t.mean(0)
            return c / (c * c).mean(0).sqrt()

        return ((bn(f @ E.T) - bn(g)) ** 2).sum(1).mean() / w.shape[0]

    def loss(self, state, batch, forward=None):
        if state["pop"] is not None:  # the N = infinity closed form (theory.noncontrastive)
            return population_loss(state["w"], state["E"], *state["pop"])
        return (forward or self._forward)(state["w"], state["E"], batch["x"], batch["view1"].to(batch["x"].dtype))

    @staticmethod
    def _update(w, E, lr: float, head_lr: float):
        _sgd([w, E], [lr, head_lr])
        E.diagonal().fill_(1.0)  # Algorithm 1 line 6

    def update(self, state, step):
        self._update(state["w"], state["E"], state["lr"], state["head_lr"])


# ------------------------------------------------------------------------------------------------
# Huang et al. 2025: one-layer softmax ViT, masked autoencoding, the structured (Phi, Upsilon) path
# ------------------------------------------------------------------------------------------------
class ViTMAEStep(Method):
    """The exact reduced parametrisation (featlearn's CPU path): the logits of a masked
    query p are ``s_pq = 1{q in U} z_q Phi[p, f(q)] + Upsilon[p, q]``, the loss is Lemma D.8's closed form in
    the unmasked area attention ``A_{p,m}``, plain SGD at ``eta`` on Phi and Upsilon, nothing after
    the update. Both area contractions (Phi's row onto the keys, the attention onto the areas: a
    gather and a segment sum) are batched GEMMs with the one-hot of the unmasked keys' areas. featlearn's loss is
    the mean over samples of the sum over masked patches (the minibatch estimate of eq. 2.8), and so is this
    loop's."""
    weights = ("phi", "upsilon")
    shape_keys = ("P", "K", "d", "gamma", "path", "batch_size")

    def state(self, model):
        return {"phi": _trainable(model.phi), "upsilon": _trainable(model.upsilon), "lr": model.lr,
                "N": model.n_areas}

    @staticmethod
    def _forward(phi, upsilon, query, cluster, area, unmasked, z, z_area, N: int):
        keys = F.one_hot(area, N).to(phi.dtype) * unmasked.unsqueeze(-1)            # [B, P, N] unmasked keys' areas
        rows = phi.view(phi.shape[0], -1, N)[query, cluster.unsqueeze(-1)]          # [B, Pq, N]: Phi[p, k N + m]
        s = upsilon[query] + rows @ (keys * z.unsqueeze(-1)).transpose(1, 2)         # [B, Pq, P] exact logits
        A = torch.softmax(s, -1) @ keys                                             # [B, Pq, N] area attention
        target = F.one_hot(area.gather(1, query), N).to(phi.dtype)
        return 0.5 * (z_area.unsqueeze(1) ** 2 * (A - target) ** 2).sum((1, 2)).mean()  # Lemma D.8

    def loss(self, state, batch, forward=None):
        return (forward or self._forward)(state["phi"], state["upsilon"], batch["masked_idx"], batch["cluster"],
                                          batch["area"], ~batch["mask"], batch["z"], batch["z_area"], state["N"])

    def update(self, state, step):
        _sgd([state["phi"], state["upsilon"]], [state["lr"]] * 2)


# ------------------------------------------------------------------------------------------------
# Huang et al. 2025: one-layer softmax ViT, contrastive learning, pooled form, stop-gradient InfoNCE (eq. 2.11)
# ------------------------------------------------------------------------------------------------
class ViTCLStep(Method):
    """Shared query rows ``Y = E Q``, logits ``Y X^T``, a row softmax, the column mean ``abar`` and
    ``F = abar X`` per view; the anchor ``X^+`` carries the gradient, the positive ``X^{++}`` and the
    unaugmented in-batch negatives ``X_j, j != i`` are stop-gradient (eq. 2.3, 2.11); plain SGD with weight decay
    ``lambda``. All three views read one GEMM ``Y X^T`` of the unmasked sample: a masked key is a zero patch
    with logit 0 (Def. 2.6), so a view's logits are that product with its masked columns set to 0 and its
    pooled output drops their values. The paper leaves open how the anchor's own sample leaves the negatives:
    featlearn sets its logit to -inf, and so does this loop."""
    weights = ("Q",)
    shape_keys = ("P", "K", "d", "gamma0", "batch_size")

    def state(self, model):
        return {"Q": _trainable(model.Q), "E": model.E, "V": model.V, "tau": model.tau, "lr": model.lr,
                "lam": model.hparams.weight_decay}

    @staticmethod
    def _forward(Q, E, V, feat_id, z, noise, mask1, mask2, tau: float):
        x = V[feat_id] * z.unsqueeze(-1) + noise                                    # noisy sample X (Assumption 4.3)
        s = (E @ Q) @ x.transpose(1, 2)                                             # [B, P, P]: the one GEMM

        def pooled(s, mask):                                                        # F = abar X (Def. 2.6)
            if mask is not None:
                s = s.masked_fill(mask.unsqueeze(1), 0.0)
            abar = torch.softmax(s, -1).mean(1)                                     # [B, P]
            if mask is not None:
                abar = abar.masked_fill(mask, 0.0)
            return (abar.unsqueeze(1) @ x).squeeze(1)

        f1, f2, fx = pooled(s, mask1), pooled(s.detach(), mask2), pooled(s.detach(), None)
        neg = (f1 @ fx.T).masked_fill(torch.eye(len(fx), dtype=torch.bool, device=fx.device), float("-inf"))
        logits = torch.cat([(f1 * f2).sum(-1, keepdim=True), neg], 1) / tau
        return tau * F.cross_entropy(logits, torch.zeros(len(f1), dtype=torch.long, device=f1.device))

    def loss(self, state, batch, forward=None):
        return (forward or self._forward)(state["Q"], state["E"], state["V"], batch["feat_id"], batch["z"],
                                          batch["noise"], batch["mask1"], batch["mask2"], state["tau"])

    def update(self, state, step):
        _sgd([state["Q"]], [state["lr"]], state["lam"])


# ------------------------------------------------------------------------------------------------
# Shi 2024, Ch. 2: two-layer truncated-ReLU network, a stage-3 minibatch step (Sec. 2.3)
# ------------------------------------------------------------------------------------------------
class TwoLayerStep(Method):
    """Stage 3 of Shi 2024, Theorem A.20 (598 of Table A.1's 600 steps): a minibatch,
    ``g(x) = sum_i a_i clamp(<w_i, x> + b_i, 0, 1)`` over the 2m mirrored neurons, the hinge loss, plain GD
    on a, w, b with the theory's ``eta = k^2 / (T m^(1/3))`` and ``p <- (1 - 2 eta lambda) p - eta grad``
    (no decay on b). The main job reaches this step after two full-batch steps; the case runs
    ``schedule: plain``, whose every step is this one. featlearn sums the mirrored halves apart (they cancel
    exactly at init), and so does this loop."""
    weights = ("a", "w", "b")
    shape_keys = ("dim", "num_patterns", "k", "batch_size", "width")

    def state(self, model):
        th = model.theory_values()
        return {"a": _trainable(model.a), "w": _trainable(model.w), "b": _trainable(model.b), "lr": th["lr3"],
                "decay": 2 * th["reg3"], "m": model.width}

    @staticmethod
    def _forward(a, w, b, x, y, m: int):
        h = torch.addmm(b, x, w.T).clamp(0, 1)
        g = h[:, :m] @ a[:m] + h[:, m:] @ a[m:]
        return (1 - y * g).clamp_min(0).mean()

    def loss(self, state, batch, forward=None):
        return (forward or self._forward)(state["a"], state["w"], state["b"], batch["x"], batch["y"], state["m"])

    def update(self, state, step):
        _sgd([state["a"], state["w"]], [state["lr"]] * 2, state["decay"])
        _sgd([state["b"]], [state["lr"]])


# ------------------------------------------------------------------------------------------------
# Shi 2024, Ch. 7: linear representation, multi-negative logistic loss, projected SGD (Sec. 7.2.2)
# ------------------------------------------------------------------------------------------------
class UniversalityStep(Method):
    """Shi 2024, Sec. 7.2.2, universal mode: ``phi(x) = W x``, the ``theory`` loss
    ``softplus(-phi(x)^T (phi(x+) - mean_batch phi(x)))`` (one GEMM per view), SGD, then the exact projection
    onto ``{||W||_2 <= 1, ||W||_F <= sqrt(r)}``: one SVD, ``sigma <- min(1, sigma / (1 + tau))`` with ``tau``
    bisected on the singular values (60 halvings). The SVD's precision is a choice: featlearn computes the projection in
    float64 and returns W's dtype, and so does this loop."""
    shape_keys = ("T", "s", "r", "u", "batch_size")

    def state(self, model):
        return {"w": _trainable(model.w), "lr": model.hparams.lr, "r": float(model.r)}

    @staticmethod
    def _forward(w, x, x_pos):
        f, f_pos = x @ w.T, x_pos @ w.T
        return F.softplus(-(f * (f_pos - f.mean(0, keepdim=True))).sum(1)).mean()

    def loss(self, state, batch, forward=None):
        return (forward or self._forward)(state["w"], batch["x"], batch["x_pos"])

    @staticmethod
    def project(w: torch.Tensor, r: float, spec: float = 1.0) -> torch.Tensor:
        U, S, Vh = torch.linalg.svd(w.double(), full_matrices=False)
        shrink = lambda tau: (S / (1 + tau)).clamp(max=spec)  # noqa: E731
        tau = 0.0
        if float((shrink(0.0) ** 2).sum()) > r:
            lo, hi = 0.0, float(((S ** 2).sum() / r).sqrt())
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if float((shrink(mid) ** 2).sum()) > r else (lo, mid)
            tau = hi
        return ((U * shrink(tau)) @ Vh).to(w.dtype)

    def update(self, state, step):
        w = state["w"]
        _sgd([w], [state["lr"]])
        w.copy_(self.project(w, state["r"]))


# ------------------------------------------------------------------------------------------------
# the main jobs' sizes (tiny: their run configs, resolved as `lightning fit --config` resolves them) and a
# few-second version of each (smoke: overrides on top)
# ------------------------------------------------------------------------------------------------
MAIN_JOBS = {"mrp": "mrp/teacher_student.yaml", "contrastive": "contrastive/random_mask.yaml",
             "noncontrastive": "noncontrastive/with_head.yaml", "vit_mae": "vit/mae.yaml", "vit_cl": "vit/cl.yaml",
             "two_layer": "two_layer/network.yaml", "universality": "universality/universal.yaml"}
# the one main job the step case does not take as it is: ch. 2's network with n = 5,000 samples instead
# of 50,000 (a step reads one minibatch, and the case builds its data several times) and the plain
# schedule with the experiment's stage-3 step x1 and no weight decay over a 600-step run
_TWO_LAYER_CHANGES = (dict(num_train=5000, num_val=16, num_test=16),
                      dict(schedule="plain", lr3_mult=1.0, reg3_mult=0.0, steps=600))


@functools.cache
def main_job(name: str) -> tuple[dict, dict]:
    """(data, model) init arguments of a method's main-job config (:data:`MAIN_JOBS`)."""
    config = Run(MAIN_JOBS[name], name).resolved()
    return dict(config["data"]["init_args"]), dict(config["model"]["init_args"])


def method(name: str, size: str) -> list[Method]:
    """The step cases of one method at ``size`` (non-contrastive: its sampled and its population step)."""
    smoke = size == "smoke"
    data, model = main_job(name)
    if name == "mrp":
        if smoke:
            data, model = dict(data, k=4, d=16, P=10, num_pretrain=32, num_downstream=16, num_test=16), dict(model, m=2)
        return [MRP("mrp", torch.float32, 10, MultiViewDataModule, data, TeacherStudentMRP, model, ("weight",))]
    if name == "contrastive":
        if smoke:
            data = dict(data, d=8, d1=32, num_negatives=16, batch_size=16, num_val=16, num_test=16)
        return [Contrastive("contrastive", torch.float32, 25, SparseCodingDataModule, data, ContrastiveModule,
                            model, ("w",))]
    if name == "noncontrastive":
        shape = dict(data, dim=12, num_patches=8, num_feature_patches=2) if smoke else data
        sample = dict(shape, mode="fixed", batch_size=None, num_train=64 if smoke else 1024, num_val=8, num_test=8)
        population = dict(shape, mode="online", batch_size=2, num_val=8, num_test=8)
        return [NonContrastive("noncontrastive sample", torch.float64, 500, TwoFeaturePatchDataModule, sample,
                               NonContrastiveModule, model, ("w", "head")),
                NonContrastive("noncontrastive population", torch.float64, 500, TwoFeaturePatchDataModule, population,
                               NonContrastiveModule, dict(model, gradient="population"), ("w", "head"))]
    smoke_vit = dict(P=64, kappa_c=0.75, kappa_s=0.5, batch_size=8, num_val=8, num_test=8)
    if name == "vit_mae":
        data = dict(data, **smoke_vit, K=2) if smoke else data
        return [ViTMAEStep("vit_mae", torch.float32, 10, GlobalLocalPatchDataModule, data, ViTMAE, model,
                           ("phi", "upsilon"))]
    if name == "vit_cl":
        data = dict(data, **smoke_vit, K=4, d=None) if smoke else data
        return [ViTCLStep("vit_cl", torch.float32, 10, GlobalLocalPatchDataModule, data, ViTCL, model, ("Q",))]
    if name == "two_layer":
        data, model = dict(data, **_TWO_LAYER_CHANGES[0]), dict(model, **_TWO_LAYER_CHANGES[1])
        if smoke:
            data, model = dict(data, dim=24, num_patterns=12, k=3, batch_size=32, num_train=64), dict(model, width=8)
        return [TwoLayerStep("two_layer", torch.float32, 50, StructuredParityDataModule, data, TwoLayerNetwork,
                             model, ("a", "w", "b"))]
    if name == "universality":
        if smoke:
            data, model = dict(data, T=2, s=2, r=4, u=2, batch_size=64, num_test=16), dict(model, probe_repeats=1)
        return [UniversalityStep("universality", torch.float32, 25, HiddenRepresentationDataModule, data,
                                 LinearContrastive, model, ("w",))]
    raise ValueError(f"no step case for {name!r}")
