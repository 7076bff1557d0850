"""The one- and two-layer transformers of Shi 2024, Ch. 4 (Li, Liang, Shi, Song, Zhou 2024, "Fourier circuits in
neural networks and transformers: a case study of modular arithmetic with multiple inputs", arXiv:2402.09469;
Figs. 4.3/4.4/C.5/C.6) on k-input modular addition, the data of :class:`FourierMLP`'s.

**The sequence.** The chapter gives no format for k inputs; its code base (Sea-Snell/grokking) writes
``[a, o, b, =, c]`` for k = 2. Here a tuple is the 2k tokens ``[a_1, o, a_2, o, ..., o, a_k, =]`` (numbers
``0 .. p-1``, ``o`` = p, ``=`` = p + 1: a vocabulary of p + 2) and the answer c is read at the last position.
``loss_positions``: ``answer`` (the default) is the cross-entropy of the answer over the p numbers only; ``all``
is the code base's objective, next-token cross-entropy over the whole vocabulary at every position of
``[a_1, o, ..., a_k, =, c]`` whose target the sequence holds (every token after ``a_1``), averaged.
Accuracy is always the answer's, its logits restricted to the p numbers.

**The network** (the code base's, sizes as options): learned token embeddings scaled by ``sqrt(hidden)`` plus
learned positional embeddings, ``layers`` pre-LayerNorm blocks (causal multi-head attention with ``heads`` heads of
``head_dim`` each, separate from ``hidden``; then a GELU MLP of ``mlp_hidden``), a final LayerNorm and an untied
linear head over the vocabulary; dropout after the embeddings, on the attention weights, on both residual branches
and inside the MLP (off in evaluation). Training: AdamW (0.9, 0.98), lr 1e-3, weight decay ``lam`` 1e-3, a linear
warm-up over 10 steps.

**Theory.** Per head h the number-number attention score matrix ``M_h = E W_K^h (W_Q^h)^T E^T`` (``p x p``, rows
the key's number, columns the query's), with E the number tokens' embeddings scaled by ``sqrt(hidden)`` as the
forward scales them. Read simply, as the chapter's formula names them: the positional embeddings (which differ
by slot), the first LayerNorm and the projections' biases (terms of one token only) are left out. The chapter
(Fig. 4.3) sees a "2-dim cosine": the power of ``M_h``'s 2-D DFT on a few frequencies. :func:`head_spectra`
measures it; ``theory/head_top_power`` (every ``log_every_n_steps`` steps) is its mean over heads. The heat map is
each embedding dimension's profile over the numbers against the Fourier modes of ``Z_p``; at the end of training
:meth:`ModularTransformer.head_dft_figure` is logged as ``heads/dft``.

Example:
    >>> from featlearn.datamodules.modular_addition import ModularAdditionDataModule
    >>> dm = ModularAdditionDataModule(k=3, p=5, batch_size=16)
    >>> model = ModularTransformer(heads=2, hidden=16, head_dim=4, mlp_hidden=32).attach(dm)
    >>> tuple(model.tokens(torch.tensor([[1, 2, 3]]))[0].tolist())
    (1, 5, 2, 5, 3, 6)
    >>> model(dm.batch(torch.arange(16), "train")["a"]).shape
    torch.Size([16, 5])
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from featlearn.datamodules.modular_addition import ModularAdditionDataModule
from featlearn.lightning_modules.modular_base import ModularAdditionMethod
from featlearn.metrics.figures import plt
from featlearn.validation import (NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, RightOpenUnitInterval,
                                  check_args, check_memory)


def head_spectra(M: torch.Tensor) -> dict[str, torch.Tensor]:
    """2-D Fourier spectra of per-head ``p x p`` matrices ``M`` ``[H, p, p]`` (p odd).

    ``top_power`` ``[H]``: the share of ``|DFT(M_h - mean(M_h))|^2`` (summed over all ``p^2`` frequencies) held by
    the largest conjugate pair ``{(f1, f2), (-f1, -f2)}``; a real matrix's power is the same on both members of a
    pair, so ``cos(2 pi (f1 x + f2 y) / p + phi)`` scores 1, ``cos(2 pi f1 x / p) cos(2 pi f2 y / p)`` 1/2 (two
    pairs) and a constant matrix 0. ``frequency`` ``[H, 2]``: that pair as ``(f1, f2)`` in ``-(p-1)/2 .. (p-1)/2``
    with ``f1 > 0``, or ``f1 = 0 < f2``.

    Example:
        >>> x = torch.arange(7.0)
        >>> M = torch.cos(2 * math.pi * (x[:, None] - 3 * x[None, :]) / 7 + 0.4)
        >>> s = head_spectra(M[None])
        >>> top, frequency = s["top_power"], s["frequency"]
        >>> round(float(top.max()), 6), tuple(frequency.flatten().tolist())
        (1.0, (1, -3))
    """
    M = M.detach().double()
    p = M.shape[-1]
    power = torch.fft.fft2(M - M.mean((-2, -1), keepdim=True)).abs().square()  # [H, p, p]
    pair = power + torch.roll(power.flip(-2, -1), shifts=(1, 1), dims=(-2, -1))  # P(f) + P(-f)
    # the frequency grid depends on p alone: built on the CPU, its indices moved to the matrices' device
    f = torch.arange(p)
    centred = torch.where(f > p // 2, f - p, f)
    f1, f2 = centred[:, None].expand(p, p).reshape(-1), centred[None, :].expand(p, p).reshape(-1)
    canonical = ((f1 > 0) | ((f1 == 0) & (f2 > 0))).nonzero().squeeze(1)  # one member of each pair
    pairs = torch.stack([f1[canonical], f2[canonical]], 1).to(M.device)
    best, where = pair.reshape(len(M), -1)[:, canonical.to(M.device)].max(1)
    total = power.sum((-2, -1))
    top = torch.where(total > 1e-300, best / total.clamp_min(1e-300), torch.zeros_like(total))
    return {"top_power": top, "frequency": pairs[where]}


class _Block(torch.nn.Module):
    """A pre-LayerNorm block: ``x + drop(attn(LN(x)))``, then ``x + drop(W_2 drop(gelu(W_1 LN(x))))``."""

    def __init__(self, hidden: int, heads: int, head_dim: int, mlp_hidden: int, dropout: float):
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, head_dim, dropout
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        inner = heads * head_dim
        self.qkv = torch.nn.Linear(hidden, 3 * inner, bias=False)  # rows: queries, keys, values (head-major)
        # a key bias adds the same q . b to every score of a query, which softmax ignores (its gradient is 0, and
        # Adam would turn float32 rounding of that 0 into steps of size lr): biases for queries and values only,
        # drawn as nn.Linear draws its bias
        bound = 1 / math.sqrt(hidden)
        self.qv_bias = torch.nn.Parameter(torch.empty(2, inner).uniform_(-bound, bound))
        self.out = torch.nn.Linear(heads * head_dim, hidden)
        self.ff1, self.ff2 = torch.nn.Linear(hidden, mlp_hidden), torch.nn.Linear(mlp_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        drop = self.dropout if self.training else 0.0
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (part.reshape(B, T, self.heads, self.head_dim).transpose(1, 2)
                   for part in (q + self.qv_bias[0], k, v + self.qv_bias[1]))
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)  # [B, H, T, d]
        x = x + F.dropout(self.out(attn.transpose(1, 2).reshape(B, T, -1)), drop, self.training)
        mlp = self.ff2(F.dropout(F.gelu(self.ff1(self.ln2(x))), drop, self.training))
        return x + F.dropout(mlp, drop, self.training)


class ModularTransformer(ModularAdditionMethod):
    """The chapter's transformer on ``[a_1, o, ..., o, a_k, =]`` (module docstring).

    Args:
        layers: transformer blocks (the chapter: 1 or 2). heads: attention heads per block (the chapter's 160).
        hidden: the residual width. head_dim: each head's query/key/value size (queries, keys and values project
            ``hidden -> heads * head_dim``, the output projection back). mlp_hidden: the MLP's width.
        dropout: the rate of every dropout (off in evaluation).
        loss_positions: ``answer`` (the answer's cross-entropy over the p numbers) or ``all`` (next-token
            cross-entropy at every known position, the code base's).
        lr: AdamW step size. betas: AdamW's. warmup_steps: linear warm-up of the step size. lam: AdamW's weight decay.
        compile: run the loss under ``torch.compile`` (``null``: never for this method; compiling it was not
            measured). seed: seed of the initialisation (PyTorch's default initialisation of each layer).
    """

    heatmap_axes = ("embedding dim", "Fourier mode")

    def __init__(self, layers: PositiveInt = 1, heads: PositiveInt = 160, hidden: PositiveInt = 128,
                 head_dim: PositiveInt = 32, mlp_hidden: PositiveInt = 512, dropout: RightOpenUnitInterval = 0.1,
                 loss_positions: Literal["answer", "all"] = "answer", lr: PositiveFloat = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.98), warmup_steps: NonNegativeInt = 10,
                 lam: NonNegativeFloat = 1e-3, compile: bool | None = None, seed: int = 0):
        check_args("model", ModularTransformer.__init__, locals())
        super().__init__()
        self.save_hyperparameters()

    def build(self, dm: ModularAdditionDataModule) -> None:
        hp = self.hparams
        self.k, self.p = dm.k, dm.p
        self.length, self.vocab = 2 * dm.k, dm.p + 2
        self.remember_splits(dm)
        inner = hp.heads * hp.head_dim
        per_block = 4 * hp.hidden * inner + 3 * inner + 2 * hp.hidden * hp.mlp_hidden + hp.mlp_hidden + 7 * hp.hidden
        weights = hp.layers * per_block + (2 * self.vocab + self.length + 2) * hp.hidden + self.vocab
        # per token and block: LN inputs, q/k/v, attention output and softmax scratch, the MLP's, residuals
        per_token = hp.layers * (5 * inner + 2 * hp.heads * self.length + 3 * hp.mlp_hidden + 8 * hp.hidden)
        rows = dm.batch_size or dm.sizes["train"]
        check_memory("model", ModularTransformer, {"heads": hp.heads, "head_dim": hp.head_dim, "hidden": hp.hidden,
                                                   "mlp_hidden": hp.mlp_hidden, "layers": hp.layers},
                     4 * 4 * weights + 4 * rows * self.length * per_token,
                     f"the transformer at {hp.layers} layer(s), {hp.heads} heads of {hp.head_dim}, hidden {hp.hidden} "
                     f"(weights, gradients, AdamW state, a batch of {rows} sequences of {self.length})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            self.embed = torch.nn.Embedding(self.vocab, hp.hidden)
            self.position = torch.nn.Embedding(self.length, hp.hidden)
            self.blocks = torch.nn.ModuleList(_Block(hp.hidden, hp.heads, hp.head_dim, hp.mlp_hidden, hp.dropout)
                                              for _ in range(hp.layers))
            self.norm = torch.nn.LayerNorm(hp.hidden)
            self.head = torch.nn.Linear(hp.hidden, self.vocab)
        self.register_ground_truth("features", dm.features.float())

    # --- the model ------------------------------------------------------------------------------
    def tokens(self, a: torch.Tensor) -> torch.Tensor:
        """Tuples ``[B, k]`` -> sequences ``[B, 2k]``: ``a_1, o, a_2, o, ..., o, a_k, =`` (o = p, = = p + 1)."""
        sep = torch.full_like(a, self.p)
        seq = torch.stack([a, sep], 2).reshape(len(a), -1)  # a_1, o, ..., a_k, o
        seq[:, -1] = self.p + 1
        return seq

    def sequence_logits(self, seq: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, p + 2]`` of token sequences ``[B, T]`` (T at most 2k)."""
        T = seq.shape[1]
        x = self.embed(seq) * math.sqrt(self.hparams.hidden) + self.position.weight[:T]
        x = F.dropout(x, self.hparams.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        """The answer's logits over the p numbers, ``[B, p]``."""
        return self.sequence_logits(self.tokens(a))[:, -1, : self.p]

    def batch_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the training objective of ``loss_positions``, the answer's logits ``[B, p]``)."""
        seq = self.tokens(batch["a"])
        logits = self.sequence_logits(seq)
        answer = logits[:, -1, : self.p]
        if self.hparams.loss_positions == "answer":
            return F.cross_entropy(answer, batch["y"]), answer
        targets = torch.cat([seq[:, 1:], batch["y"].unsqueeze(1)], 1)  # o, a_2, ..., =, c
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1)), answer

    def finish_step(self, step: int) -> None:
        if self.theory_due():
            self.log("theory/head_top_power", self.head_top_power())

    # --- theory ---------------------------------------------------------------------------------
    @torch.no_grad()
    def head_matrices(self, layer: int = 0) -> torch.Tensor:
        """``M_h = E W_K^h (W_Q^h)^T E^T`` of every head of block ``layer``: ``[heads, p, p]`` (module docstring)."""
        hp = self.hparams
        E = self.embed.weight[: self.p].double() * math.sqrt(hp.hidden)  # [p, hidden]
        W = self.blocks[layer].qkv.weight.double().reshape(3, hp.heads, hp.head_dim, hp.hidden)
        keys, queries = torch.einsum("hdn,pn->hpd", W[1], E), torch.einsum("hdn,pn->hpd", W[0], E)
        return keys @ queries.transpose(1, 2)

    def head_top_power(self) -> float:
        """The mean over heads (of every block) of :func:`head_spectra`'s ``top_power``."""
        return float(torch.cat([head_spectra(self.head_matrices(i))["top_power"]
                                for i in range(self.hparams.layers)]).mean())

    @torch.no_grad()
    def correlations(self) -> torch.Tensor:
        """Embedding dims x Fourier modes ``[hidden, p - 1]``: each dimension's centred profile over the p number
        tokens, normalised, against the real Fourier modes of ``Z_p`` (cosines in [-1, 1])."""
        profile = self.embed.weight[: self.p].T.float()  # [hidden, p]
        profile = profile - profile.mean(1, keepdim=True)
        return (profile / profile.norm(dim=1, keepdim=True).clamp_min(1e-30)) @ self.features.T

    @torch.no_grad()
    def head_dft_figure(self, count: int = 4, layer: int = 0):
        """A figure of the ``count`` heads of block ``layer`` with the most concentrated spectra: ``M_h`` (top row)
        and ``|DFT(M_h - mean)|`` with frequency 0 centred (bottom row)."""
        M = self.head_matrices(layer)
        spectra = head_spectra(M)
        chosen = spectra["top_power"].argsort(descending=True)[: min(count, len(M))].tolist()
        fig, axes = plt.subplots(2, len(chosen), figsize=(3.0 * len(chosen), 6.0), squeeze=False,
                                 constrained_layout=True)
        for col, h in enumerate(chosen):
            m = M[h] - M[h].mean()
            dft = torch.fft.fftshift(torch.fft.fft2(m).abs()).cpu().numpy()
            axes[0, col].imshow(m.cpu().numpy(), cmap="RdBu_r", interpolation="nearest")
            axes[0, col].set(title=f"head {h}", xlabel="query number", ylabel="key number")
            half = self.p // 2
            axes[1, col].imshow(dft, cmap="viridis", interpolation="nearest", extent=(-half - .5, half + .5,
                                                                                      half + .5, -half - .5))
            f1, f2 = spectra["frequency"][h].tolist()
            axes[1, col].set(title=f"|DFT| top ({f1}, {f2}): {float(spectra['top_power'][h]):.2f}",
                             xlabel="query frequency", ylabel="key frequency")
        return fig

    def on_train_end(self) -> None:
        if self.summary_writer() is not None:
            self.log_figure("heads/dft", self.head_dft_figure())
        super().on_train_end()

    def final_metrics(self) -> dict[str, float]:
        return {"head_top_power": self.head_top_power(), **self.accuracy_results()}
