"""A small causal decoder trained on key-value retrieval, and GemFilter on it (Shi 2024, Ch. 9 = Shi, Ming, Nguyen,
Liang, Joty, "Discovering the Gems in Early Layers: Accelerating Long-Context LLMs with 1000x Input Token Reduction",
arXiv:2409.17422, Algorithm 2 and its code in App. G.4.1).

**The network**: token embeddings, ``layers`` pre-norm blocks (RMSNorm; causal attention with ``heads`` query heads
and ``kv_heads`` key-value heads, grouped-query attention when fewer; rotary position embeddings (RoPE) on the first
``rope_dims`` coordinates of each query and key head, so that a prompt's positions can be renumbered, the others
position-free; a GELU MLP), a final RMSNorm and an untied head over the vocabulary. Before attention, queries, keys
and values pass a causal depthwise convolution of width ``conv`` along the sequence (Primer's multi-DConv-head
attention, So et al. 2021): a key then carries its previous token, so one layer can match the asked key and read
the value after it (without it, the two-layer induction circuit did not form in 1000-2500 CPU steps; with it, in
about 300). Partial RoPE keeps the content match working on prompts longer than the training ones. Trained by
AdamW (linear warm-up, cosine decay) on the cross-entropy of the asked keys' values (the data's ``targets`` at
``target_positions``).

**GemFilter** (:meth:`RetrievalDecoder.gemfilter`): run layers ``0 .. r - 1`` and the projections of layer ``r``
(``r`` is **0-based**: layer ``r`` here is the chapter's "(r+1)-th layer"; the code of the paper slices
``layers[:r + 1]``), take the last query row ``q_n`` of layer ``r`` (after RoPE), score every key by
``sum_heads q_n . k_j`` (key heads repeated for grouped queries), average-pool the scores (kernel 5), keep the top
``k`` positions sorted ascending (:mod:`featlearn.kernels.token_selection`) and run the whole network on those
``k`` tokens as a new prompt, positions renumbered ``0 .. k - 1``. Ablations (App. G.4.4): the selecting row is
the middle one (``row="middle"``) or the one whose query (all heads) has the largest l2 norm (``"largest_l2"``);
their scores are masked to the row's causal past. ``one_run=True`` (App. G.4.5, GemFilter-One-Run): no second
pass; the whole prompt runs through every layer, the key-value cache is evicted to the selected positions (original
positions kept) and the last token is decoded against it: in every layer its attention reads the selected keys
and its own.

Logged: ``train/loss``; ``val/loss`` and ``val/accuracy`` (the full pass's answer); ``val/recall_r{r}_k{k}`` (the
share of the needle's two tokens the last row at layer ``r`` selects with budget ``k``, every layer and each of
``val_budgets``) and ``val/gemfilter_accuracy`` (the second pass's answer at ``val_layer`` and the first budget).
Heat map: that recall, filter layer x budget.

Example:
    >>> from featlearn.datamodules.kv_retrieval import KVRetrievalDataModule
    >>> dm = KVRetrievalDataModule(context=64, pairs=4, batch_size=8)
    >>> model = RetrievalDecoder(layers=2, heads=2, kv_heads=1, head_dim=8, hidden=16, mlp_hidden=32).attach(dm)
    >>> b = dm.batch(torch.arange(8), "val")
    >>> out = model.gemfilter(b["tokens"], layer=1, k=16, needle=b["needle"])
    >>> tuple(out["logits"].shape), tuple(out["indices"].shape), bool((out["indices"].diff(dim=1) > 0).all())
    ((8, 66), (8, 16), True)
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from featlearn.datamodules.kv_retrieval import KVRetrievalDataModule
from featlearn.errors import ConfigError
from featlearn.kernels.token_selection import select_tokens, selection_scores, sorted_top_k
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.validation import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_args

ROWS = ("last", "middle", "largest_l2")


def needle_hits(indices: torch.Tensor, needle: torch.Tensor) -> torch.Tensor:
    """Which of the needle's positions ``needle [B, m]`` the selected ``indices [B, k]`` hold: ``[B, m]`` bool."""
    return (indices.unsqueeze(2) == needle.unsqueeze(1)).any(1)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float, dims: int | None = None) -> torch.Tensor:
    """Rotary embedding of the first ``dims`` (even; default all) coordinates of ``x [B, H, n, D]`` at ``positions``
    (``[n]`` or ``[B, n]``), rotate-half form; the other coordinates are left as they are (partial RoPE)."""
    dims = x.shape[-1] if dims is None else dims
    if dims == 0:
        return x
    half = dims // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.to(torch.float32).unsqueeze(-1) * freq  # [(B,) n, half]
    if angle.dim() == 3:
        angle = angle.unsqueeze(1)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], -1)


class Block(nn.Module):
    """One pre-norm decoder block (module docstring)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, mlp_hidden: int, base: float,
                 conv: int = 0, rope_dims: int | None = None):
        super().__init__()
        self.shape, self.base, self.rope_dims = (heads, kv_heads, head_dim), base, rope_dims
        width = (heads + 2 * kv_heads) * head_dim
        self.conv = nn.Conv1d(width, width, conv, groups=width, padding=conv - 1) if conv else None
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.wq = nn.Linear(hidden, heads * head_dim)  # biases on queries and keys: position-only scores possible
        self.wk = nn.Linear(hidden, kv_heads * head_dim)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, mlp_hidden), nn.Linear(mlp_hidden, hidden)

    def qkv(self, h: torch.Tensor, positions: torch.Tensor):
        """Queries ``[B, H, n, D]``, keys and values ``[B, H_kv, n, D]``; RoPE on queries and keys."""
        (B, n, _), (H, Hkv, D) = h.shape, self.shape
        x = self.norm1(h)
        qkv = torch.cat([self.wq(x), self.wk(x), self.wv(x)], -1)
        if self.conv is not None:  # causal depthwise convolution along the sequence (Primer's multi-DConv-head)
            qkv = self.conv(qkv.transpose(1, 2))[..., :n].transpose(1, 2)
        q, k, v = (part.view(B, n, heads, D).transpose(1, 2)
                   for part, heads in zip(qkv.split((H * D, Hkv * D, Hkv * D), -1), (H, Hkv, Hkv)))
        return rope(q, positions, self.base, self.rope_dims), rope(k, positions, self.base, self.rope_dims), v

    def mix(self, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for the rows of ``h`` whose queries are ``q``: attention (causal, or ``mask``), MLP."""
        rep = self.shape[0] // self.shape[1]
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=mask, is_causal=mask is None)
        h = h + self.wo(a.transpose(1, 2).flatten(2))
        return h + self.down(F.gelu(self.up(self.norm2(h))))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None):
        q, k, v = self.qkv(h, positions)
        return self.mix(h, q, k, v, mask), (q, k, v)


class RetrievalDecoder(FeatureLearningModule):
    """The decoder and GemFilter (module docstring).

    Args:
        layers, heads, head_dim, hidden, mlp_hidden: the network's sizes.
        kv_heads: key-value heads (a divisor of ``heads``; None: ``heads``, no grouping).
        rope_base, rope_dims: RoPE's base and the coordinates of a head it rotates (even, at most ``head_dim``;
            None: all).
        conv: the width of the causal depthwise convolution of queries, keys and values (0: none).
        lr, weight_decay, warmup: AdamW's step size (after a linear warm-up over ``warmup`` steps, cosine to 0),
            weight decay.
        val_budgets: the budgets ``k`` of the logged recall; the first is GemFilter's in ``val/gemfilter_accuracy``
            (None: 16 and 32).
        val_layer: the filter layer (0-based) of ``val/gemfilter_accuracy``.
        pool_kernel: the selection's average-pooling kernel (odd).
        seed: the initial weights' seed.
    """

    datamodule_class = KVRetrievalDataModule
    heatmap_axes = ("filter layer (0-based)", "budget k")

    def __init__(self, layers: PositiveInt = 4, heads: PositiveInt = 4, kv_heads: PositiveInt | None = None,
                 head_dim: PositiveInt = 16, hidden: PositiveInt = 64, mlp_hidden: PositiveInt = 256,
                 rope_base: PositiveFloat = 10000.0, rope_dims: NonNegativeInt | None = 8, conv: NonNegativeInt = 3,
                 lr: PositiveFloat = 3e-3, weight_decay: NonNegativeFloat = 0.0, warmup: NonNegativeInt = 50,
                 val_budgets: list[PositiveInt] | None = None, val_layer: NonNegativeInt = 0,
                 pool_kernel: PositiveInt = 5, seed: int = 0):
        check_args("model", RetrievalDecoder.__init__, locals())
        if kv_heads is not None and heads % kv_heads:
            raise ConfigError("model.kv_heads", f"a divisor of heads = {heads}", kv_heads)
        if rope_dims is not None and (rope_dims % 2 or rope_dims > head_dim):
            raise ConfigError("model.rope_dims", f"even and at most head_dim = {head_dim} (RoPE rotates pairs)",
                              rope_dims)
        if rope_dims is None and head_dim % 2:
            raise ConfigError("model.head_dim", "even when model.rope_dims is null (RoPE rotates pairs)", head_dim)
        if pool_kernel % 2 == 0:
            raise ConfigError("model.pool_kernel", "odd (the pooled score stays centred on its token)", pool_kernel)
        if val_layer >= layers:
            raise ConfigError("model.val_layer", f"a layer index in [0, {layers - 1}] (0-based)", val_layer)
        if val_budgets is not None and not val_budgets:
            raise ConfigError("model.val_budgets", "a non-empty list of budgets", val_budgets)
        super().__init__()
        self.save_hyperparameters()

    def build(self, dm: KVRetrievalDataModule) -> None:
        hp = self.hparams
        self.budgets = list(hp.val_budgets or (16, 32))
        if max(self.budgets) > dm.context:
            raise ConfigError("model.val_budgets", f"budgets of at most data.context = {dm.context}", self.budgets)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            self.embedding = nn.Embedding(dm.vocab_size, hp.hidden)
            self.blocks = nn.ModuleList(Block(hp.hidden, hp.heads, hp.kv_heads or hp.heads, hp.head_dim, hp.mlp_hidden,
                                              hp.rope_base, hp.conv, hp.rope_dims) for _ in range(hp.layers))
            self.norm, self.head = nn.RMSNorm(hp.hidden), nn.Linear(hp.hidden, dm.vocab_size, bias=False)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.register_buffer("recall_table", torch.zeros(hp.layers, len(self.budgets)), persistent=False)
        self._recall_sums, self._recall_count = None, 0

    # --- the network -------------------------------------------------------------------------------
    def run(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            blocks: int | None = None, keep: str = ""):
        """Hidden states after the first ``blocks`` blocks (all by default) and, per block run, the tensors named
        in ``keep`` (``q``, ``k``: queries and keys after RoPE, ``v``: values, ``h``: the block's input; ``"kv"``
        is the cache a generation keeps).
        ``positions`` default to ``0 .. n - 1``; ``mask`` (boolean, True = attend) replaces the causal mask."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h, record = self.embedding(tokens), []
        for block in self.blocks[:blocks]:
            h_in = h
            h, (q, k, v) = block(h, positions, mask)
            record.append(tuple({"q": q, "k": k, "v": v, "h": h_in}[c] for c in keep))
        return h, record

    def forward(self, tokens: torch.Tensor, at: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, n, V]``, or ``[B, m, V]`` at the positions ``at [B, m]``."""
        h, _ = self.run(tokens, positions, mask)
        if at is not None:
            h = h.gather(1, at.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return self.head(self.norm(h))

    def prefix(self, tokens: torch.Tensor, layer: int, every: bool = True) -> dict[int, tuple]:
        """GemFilter's first pass: blocks ``0 .. layer - 1`` in full and block ``layer``'s projections (0-based);
        returns layer -> ``(q [B, H, n, D], k [B, H_kv, n, D])`` after RoPE, for layers ``0 .. layer`` (``every``)
        or ``layer`` alone (what the prompt phase keeps)."""
        self._check_layer(layer)
        h, record = self.run(tokens, blocks=layer, keep="qk" if every else "")
        q, k, _ = self.blocks[layer].qkv(h, torch.arange(tokens.shape[1], device=tokens.device))
        return {**(dict(enumerate(record)) if every else {}), layer: (q, k)}

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < len(self.blocks):
            raise ConfigError("gemfilter.layer", f"a layer index in [0, {len(self.blocks) - 1}] (0-based)", layer)

    # --- GemFilter ---------------------------------------------------------------------------------
    def select(self, q: torch.Tensor, keys: torch.Tensor, k: int, row: str = "last", pool_kernel: int | None = None,
               keep_last: int = 0) -> torch.Tensor:
        """The ``k`` selected positions ``[B, k]`` (ascending) from one query row of ``q [B, H, n, D]``; the last
        ``keep_last`` positions are always among them."""
        pool = self.hparams.pool_kernel if pool_kernel is None else pool_kernel
        if row == "last" and not keep_last:
            return select_tokens(q[:, :, -1], keys, k, pool)
        B, H, n, D = q.shape
        rows = (q.square().sum((1, 3)).argmax(1) if row == "largest_l2"
                else torch.full((B,), n - 1 if row == "last" else (n - 1) // 2, device=q.device))
        q_row = q.gather(2, rows.view(B, 1, 1, 1).expand(B, H, 1, D)).squeeze(2)
        position = torch.arange(n, device=q.device)
        scores = selection_scores(q_row, keys, pool).masked_fill(position > rows.unsqueeze(1), -math.inf)
        return sorted_top_k(scores.masked_fill(position >= n - keep_last, math.inf), k)

    def gemfilter(self, tokens: torch.Tensor, layer: int, k: int, row: Literal["last", "middle", "largest_l2"] = "last",
                  one_run: bool = False, needle: torch.Tensor | None = None, pool_kernel: int | None = None,
                  keep_last: int = 0, prefix: dict | None = None, cache: list | None = None) -> dict[str, torch.Tensor]:
        """GemFilter (module docstring) on ``tokens [B, n]`` at the 0-based filter ``layer`` with budget ``k``:
        ``logits [B, V]`` of the answer, the selected ``indices [B, k]`` and, given the ``needle [B, m]``
        positions, ``recall [B]`` (the share of them selected). ``keep_last`` (our addition, 0 in the chapter):
        the prompt's last tokens (the question) are always kept. ``prefix``: :meth:`prefix`'s output holding
        ``layer``, ``cache``: :meth:`one_run`'s (both shared between calls). Bad values are refused, naming the
        argument, before any work."""
        self._check_layer(layer)
        n = tokens.shape[1]
        if not 1 <= k <= n:
            raise ConfigError("gemfilter.k", f"a budget in [1, the context's {n} tokens]", k)
        if row not in ROWS:
            raise ConfigError("gemfilter.row", f"one of {ROWS}", row)
        if pool_kernel is not None and (pool_kernel < 1 or pool_kernel % 2 == 0):
            raise ConfigError("gemfilter.pool_kernel", "an odd integer >= 1", pool_kernel)
        if not 0 <= keep_last <= k:
            raise ConfigError("gemfilter.keep_last", f"in [0, k = {k}]", keep_last)
        with torch.no_grad():
            q, keys = (prefix if prefix is not None else self.prefix(tokens, layer, every=False))[layer]
            indices = self.select(q, keys, k, row, pool_kernel, keep_last)
            logits = self.one_run(tokens, indices, cache) if one_run else self.second_pass(tokens, indices)
        out = {"logits": logits, "indices": indices}
        if needle is not None:
            out["recall"] = needle_hits(indices, needle).float().mean(1)
        return out

    def second_pass(self, tokens: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The answer's logits ``[B, V]`` from the whole network on the selected tokens, a new prompt (positions
        ``0 .. k - 1``)."""
        return self(tokens.gather(1, indices), at=torch.full_like(indices[:, :1], indices.shape[1] - 1))[:, 0]

    def one_run(self, tokens: torch.Tensor, indices: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        """GemFilter-One-Run's answer logits ``[B, V]``: the prompt's last token decoded against every layer's
        key-value cache evicted to ``indices`` (its own entry added). ``cache``: :meth:`run`'s record with
        ``keep="kvh"`` on ``tokens`` (its rows before the last are the prefill of the prompt without its last token)."""
        B, n = tokens.shape
        if cache is None:
            _, cache = self.run(tokens, keep="kvh")
        window = max(1, self.hparams.conv)  # the convolution reads the last token's window - 1 predecessors
        keep = torch.zeros(B, n, dtype=torch.bool, device=tokens.device).scatter(1, indices, True)
        keep[:, -1] = True
        h, positions = self.embedding(tokens[:, -1:]), torch.arange(n - window, n, device=tokens.device)
        for block, (k, v, h_in) in zip(self.blocks, cache):
            q1, k1, v1 = (t[:, :, -1:] for t in block.qkv(torch.cat([h_in[:, n - window:n - 1], h], 1), positions))
            k, v = torch.cat([k[:, :, :n - 1], k1], 2), torch.cat([v[:, :, :n - 1], v1], 2)
            h = block.mix(h, q1, k, v, keep[:, None, None, :])
        return self.head(self.norm(h[:, 0]))

    # --- training and evaluation -------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        logits = self(batch["tokens"], at=batch["target_positions"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        hp, tokens, needle = self.hparams, batch["tokens"], batch["needle"]
        B = len(tokens)
        with torch.no_grad():
            h, record = self.run(tokens, keep="qk")
            logits = self.head(self.norm(h[:, -1]))
            found = lambda idx: needle_hits(idx, needle).float().mean()
            layer_scores = [selection_scores(q[:, :, -1], keys, hp.pool_kernel) for q, keys in record]  # once a layer
            recall = torch.stack([torch.stack([found(sorted_top_k(s, k)) for k in self.budgets]) for s in layer_scores])
            prefix = dict(enumerate(record))
            second = self.gemfilter(tokens, hp.val_layer, self.budgets[0], prefix=prefix)["logits"]
        log = lambda name, value: self.log(name, value, batch_size=B, sync_dist=True)
        log("val/loss", F.cross_entropy(logits, batch["answer"]))
        log("val/accuracy", (logits.argmax(-1) == batch["answer"]).float().mean())
        log("val/gemfilter_accuracy", (second.argmax(-1) == batch["answer"]).float().mean())
        for r in range(len(record)):
            for j, k in enumerate(self.budgets):
                log(f"val/recall_r{r}_k{k}", recall[r, j])
        self._recall_sums = recall * B + (self._recall_sums if self._recall_sums is not None else 0)
        self._recall_count += B

    def on_validation_epoch_start(self) -> None:
        self._recall_sums, self._recall_count = None, 0

    def on_validation_epoch_end(self) -> None:
        if self._recall_sums is not None:
            self.recall_table.copy_(self._recall_sums / self._recall_count)

    def correlations(self) -> torch.Tensor:
        """The last validation's recall of the needle, filter layer x budget."""
        return self.recall_table

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, 0.98), weight_decay=hp.weight_decay)
        if self._trainer is None:
            return optimizer
        steps = max(1, int(self.trainer.estimated_stepping_batches))

        def scale(step: int) -> float:
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - hp.warmup) / max(1, steps - hp.warmup))))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def final_metrics(self) -> dict[str, float]:
        out = {}
        for name in ("val/accuracy", "val/gemfilter_accuracy", "val/loss"):
            value = self.logged(name)
            if value is not None:
                out[name.removeprefix("val/")] = float(value)
        for j, k in enumerate(self.budgets):
            out.update({f"recall_r{r}_k{k}": float(self.recall_table[r, j]) for r in range(len(self.blocks))})
        return out
