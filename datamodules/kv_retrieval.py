"""Long-context key-value retrieval with a needle (Shi 2024, Ch. 9 = Shi, Ming, Nguyen, Liang, Joty, "Discovering the
Gems in Early Layers: Accelerating Long-Context LLMs with 1000x Input Token Reduction", arXiv:2409.17422): the data
of :mod:`featlearn.lightning_modules.retrieval_decoder`, a synthetic stand-in for the chapter's Needle in a Haystack.

A prompt of ``n`` tokens is ``[BOS, haystack (n - 1 - 2q tokens), QUERY, K_1, V_1, ..., K_{q-1}, V_{q-1}, K*]``.
The haystack is random filler tokens with ``pairs`` key-value pairs ``K V`` (adjacent tokens; the keys distinct,
the values drawn independently) written into it. One pair is the needle ``(K*, V*)``: its key is asked last, and
the answer is ``V*``. Its start is at depth ``depth`` of the haystack (0: first, 1: last slot), drawn uniformly,
or on validation and test prompts from the grid ``eval_depths`` (prompt ``i`` at ``eval_depths[i % len]``). The
other pairs sit at random slots of the same parity as the needle's, so pairs never overlap. Training prompts ask
``queries`` keys (the last one the needle's; the others' values are shown, as in multi-query associative recall,
so one prompt trains ``q`` answers); validation and test prompts ask the needle only (``q = 1``).
``train_context`` (default ``context``) sets the training prompts' length: train short, evaluate long.

Vocabulary: ``0`` BOS, ``1`` QUERY, then ``fillers`` filler tokens, ``keys`` key tokens and ``values`` value tokens.

The ground truth: ``needle [B, 2]``, the positions of ``K*`` and ``V*`` in the prompt, and ``answer [B] = V*``.

Example:
    >>> dm = KVRetrievalDataModule(context=64, pairs=4, eval_depths=[0.0, 0.5, 1.0])
    >>> b = dm.batch(torch.arange(3), "val")
    >>> tok, needle = b["tokens"], b["needle"]
    >>> value = tok.gather(1, needle[:, 1:]).squeeze(1)
    >>> tuple(tok.shape), tuple(needle[:, 0].tolist()), bool((value == b["answer"]).all())
    ((3, 64), (1, 31, 60), True)
    >>> bool((tok[:, -1] == tok.gather(1, needle[:, :1]).squeeze(1)).all())  # the last token asks the needle's key
    True
"""
from __future__ import annotations

from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.validation import ClosedUnitInterval, PositiveInt, check_args

BOS, QUERY = 0, 1
_Q_DEPTH, _Q_SLOTS, _Q_KEYS, _Q_VALUES, _Q_FILL = 0, 1, 2, 3, 4  # the random quantities' streams within a split


def slots(haystack: int) -> int:
    """The fewest pair slots a haystack of this length offers (the needle's parity with the fewer slots)."""
    return (haystack - 3) // 2 + 1 if haystack >= 3 else 0


class KVRetrievalDataModule(SyntheticDataModule):
    """Key-value retrieval prompts with one needle (module docstring).

    Args:
        context: ``n``, the validation and test prompts' length (BOS and the query included).
        train_context: the training prompts' length (default ``context``).
        pairs: key-value pairs in the haystack, the needle included (at most ``keys``).
        queries: keys asked per training prompt (the last one the needle's); evaluation prompts ask one.
        fillers, keys, values: the vocabulary's filler, key and value tokens.
        eval_depths: the needle depths of validation and test prompts, cycled over the prompts (None: uniform).
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule`.
    """

    def __init__(self, context: PositiveInt = 512, train_context: PositiveInt | None = None, pairs: PositiveInt = 8,
                 queries: PositiveInt = 4, fillers: PositiveInt = 16, keys: PositiveInt = 32,
                 values: PositiveInt = 16, eval_depths: list[ClosedUnitInterval] | None = None,
                 mode: Literal["fixed", "online"] = "online", batch_size: PositiveInt | None = 32,
                 num_val: PositiveInt = 256, num_test: PositiveInt = 256, **synthetic):
        check_args("data", KVRetrievalDataModule.__init__, locals())
        if pairs > keys:
            raise ConfigError("data.keys", f"at least pairs = {pairs} (the keys of a prompt are distinct)", keys)
        if queries > pairs:
            raise ConfigError("data.queries", f"at most pairs = {pairs} (each query asks another pair)", queries)
        if eval_depths is not None and not eval_depths:
            raise ConfigError("data.eval_depths", "a non-empty list of depths in [0, 1] or null", eval_depths)
        train_field = "data.context" if train_context is None else "data.train_context"
        for name, n, q in (("data.context", context, 1), (train_field, train_context or context, queries)):
            if slots(n - 1 - 2 * q) < pairs:  # pair slots of the shorter haystack (needle parity with fewer slots)
                raise ConfigError(name, f"long enough for {pairs} pairs and {q} queries (at least "
                                        f"{2 * pairs + 2 + 2 * q})", n)
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        self.context, self.train_context = context, train_context or context
        self.pairs, self.queries, self.fillers, self.keys, self.values = pairs, queries, fillers, keys, values
        self.eval_depths = None if eval_depths is None else [float(d) for d in eval_depths]
        self.vocab_size = 2 + fillers + keys + values
        self.check_memory({"context": context, "train_context": self.train_context},
                          train_values=self.train_context + 2 * queries + 4, eval_values=context + 6, out_bytes=8)

    def first_token(self, kind: Literal["filler", "key", "value"]) -> int:
        """The id of the first token of a kind (fillers, keys and values are contiguous ranges)."""
        return {"filler": 2, "key": 2 + self.fillers, "value": 2 + self.fillers + self.keys}[kind]

    def prompt_length(self, split: str) -> int:
        return self.train_context if split == "train" else self.context

    def _depth(self, index: torch.Tensor, split: str) -> torch.Tensor:
        if split != "train" and self.eval_depths is not None:
            grid = torch.tensor(self.eval_depths, dtype=torch.float64, device=index.device)
            return grid[index % len(grid)]
        return rng.uniform(self.seed, self.stream(split, _Q_DEPTH), index, (), torch.float64)

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """``tokens [B, n]``; ``targets [B, q]`` (the asked keys' values, the needle's last) predicted at
        ``target_positions [q]`` (the asked keys' positions); ``answer [B]`` (``V*``), ``needle [B, 2]`` (the
        positions of ``K*``, ``V*``) and ``depth [B]``."""
        seed, st, device = self.seed, self.stream, index.device
        n, q, P = self.prompt_length(split), (self.queries if split == "train" else 1), self.pairs
        H, B = n - 1 - 2 * q, len(index)
        depth = self._depth(index, split)
        s = (depth * (H - 2)).round().long()  # the needle's start in the haystack, 0 .. H - 2
        # pair slots: starts of the needle's parity, t_j = parity + 2 j <= H - 2; the needle's own slot excluded
        j = torch.arange(H // 2, device=device)
        t = (s % 2).unsqueeze(1) + 2 * j
        u = rng.uniform(seed, st(split, _Q_SLOTS), index, (H // 2,))
        u = torch.where((t <= H - 2) & (t != s.unsqueeze(1)), u, 2.0)
        others = t.gather(1, torch.argsort(u, dim=1, stable=True)[:, :P - 1])
        starts = torch.cat([s.unsqueeze(1), others], 1) + 1  # [B, P], pair 0 the needle; +1: after BOS
        key = rng.permutation(seed, st(split, _Q_KEYS), index, self.keys)[:, :P] + self.first_token("key")
        value = rng.randint(seed, st(split, _Q_VALUES), index, (P,), self.values) + self.first_token("value")
        tokens = rng.randint(seed, st(split, _Q_FILL), index, (n,), self.fillers) + self.first_token("filler")
        tokens[:, 0] = BOS
        tokens.scatter_(1, starts, key).scatter_(1, starts + 1, value)
        asked = torch.cat([torch.arange(1, q, device=device), torch.zeros(1, dtype=torch.long, device=device)])
        tail = torch.stack([key[:, asked], value[:, asked]], 2).reshape(B, 2 * q)[:, :-1]  # K_1 V_1 ... K*
        tokens[:, H + 1] = QUERY
        tokens[:, H + 2:] = tail
        target_positions = H + 2 + 2 * torch.arange(q, device=device)
        return {"tokens": tokens, "targets": value[:, asked], "target_positions": target_positions.expand(B, q),
                "answer": value[:, 0], "needle": torch.stack([starts[:, 0], starts[:, 0] + 1], 1),
                "depth": depth.float()}

    @property
    def features(self) -> torch.Tensor:
        """The key tokens' one-hot rows ``[keys, vocab]``: what a query has to match."""
        return torch.eye(self.vocab_size)[self.first_token("key"):self.first_token("value")]
