"""Points and derived values of an experiment's or a sweep's settings: :func:`grid` and :func:`zipped` make
points from axes, and a :class:`Rule` computes a per-point value from a swept one (the sweep files' ``derived``
rules). Experiments with a size rule in code apply it to their points before making
:class:`~featlearn.experiments.study.Run` s.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal

from featlearn.errors import ConfigError


def grid(**axes) -> list[dict]:
    """Every combination of the axes' values, the last axis fastest.

    Example:
        >>> grid(q=[3], lr_scale=[0.5, 1])
        [{'q': 3, 'lr_scale': 0.5}, {'q': 3, 'lr_scale': 1}]
    """
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def zipped(**axes) -> list[dict]:
    """The i-th values of every axis together (the axes must have one length).

    Example:
        >>> zipped(d=[32, 64], d1=[256, 512])
        [{'d': 32, 'd1': 256}, {'d': 64, 'd1': 512}]
    """
    lengths = {k: len(v) for k, v in axes.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigError("sweep", "lists of one length (zipped points)", lengths)
    return [dict(zip(axes, combo)) for combo in zip(*axes.values())]


@dataclass(frozen=True)
class Rule:
    """A per-point value from a swept value ``x``: ``times * x**power`` (or ``times * ln x`` with ``log``),
    clamped to ``[at_least, at_most]`` and rounded to an integer (``ceil``, ``floor``, ``nearest``); or
    ``table[x]``.

    Example:
        >>> Rule(of="k", times=4, at_least=256, round="ceil").apply(100)
        400
        >>> Rule(of="k", log=True, times=2.5, at_least=4, round="ceil").apply(16)
        7
        >>> Rule(of="k", table={16: 300, 32: 100}).apply(32)
        100
    """
    of: str
    times: float = 1.0
    power: float = 1.0
    log: bool = False
    at_least: float | None = None
    at_most: float | None = None
    round: Literal["ceil", "floor", "nearest"] | None = None
    table: dict[int, Any] | None = None

    def apply(self, x):
        if self.table is not None:
            return self.table[x]
        value = self.times * (math.log(x) if self.log else x ** self.power)
        if self.at_least is not None:
            value = max(value, self.at_least)
        if self.at_most is not None:
            value = min(value, self.at_most)
        if self.round is not None:
            value = int({"ceil": math.ceil, "floor": math.floor, "nearest": round}[self.round](value))
        return value

    def text(self, name: str) -> str:
        """The rule as a formula, e.g. ``d = max(256, ceil(4 k))``."""
        if self.table is not None:
            return f"{name} = table of {self.of}: " + ", ".join(f"{k}: {v}" for k, v in self.table.items())
        x = self.of
        expr = f"ln {x}" if self.log else (x if self.power == 1 else f"{x}^{self.power:g}")
        expr = expr if self.times == 1 else f"{self.times:g} {expr}"
        if self.round is not None:
            expr = f"{self.round}({expr})"
        if self.at_least is not None:
            expr = f"max({self.at_least:g}, {expr})"
        if self.at_most is not None:
            expr = f"min({self.at_most:g}, {expr})"
        return f"{name} = {expr}"


__all__ = ["Rule", "grid", "zipped"]
