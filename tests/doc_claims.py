"""Keeping the documentation's numbers in step with the committed tables.

A claim is a sentence fragment of a page (README.md or docs/) rebuilt from a committed results file: the
test formats the template with numbers read from the JSON and asserts that the exact text is on the page.
If a table is re-run and a number moves, or a page is edited and no longer quotes the table, the test fails
and names both. A claim that states something about every seed ("in every seed", "at least 0.95") checks
that condition over the per-seed values with ``require`` before it renders, so a sentence cannot survive a
re-run that contradicts it.

    from doc_claims import Claim, check_claims, load, spread

    CLAIMS = [
        Claim("docs/methods/vit.md", "MAE own-area attention {v}",
              lambda: {"v": spread(load("benchmarks/results/vit/vit_table.json")[0]["per_seed"]["own"])}),
    ]

    def test_vit_claims():
        check_claims(CLAIMS)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]


class ClaimBroken(AssertionError):
    """A committed table no longer supports a sentence of the documentation."""


def load(path: str):
    """The committed JSON at ``path`` (relative to the repository root)."""
    return json.loads((ROOT / path).read_text())


def require(condition: bool, what: str) -> None:
    """Raise :class:`ClaimBroken` with ``what`` unless ``condition`` holds (for "in every seed" claims)."""
    if not condition:
        raise ClaimBroken(what)


def fmt(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals, as the pages print numbers."""
    return f"{value:.{digits}f}"


def spread(values: Sequence[float], digits: int = 3) -> str:
    """``mean (min-max)`` over seeds, the one way pages quote a number measured over several seeds."""
    values = [float(v) for v in values]
    if not values:
        raise ClaimBroken("no per-seed values to quote")
    mean = sum(values) / len(values)
    return f"{fmt(mean, digits)} ({fmt(min(values), digits)}-{fmt(max(values), digits)})"


@dataclass(frozen=True)
class Claim:
    """``template`` formatted with ``values()`` must appear verbatim (whitespace-normalised) in ``page``."""

    page: str
    template: str
    values: Callable[[], dict]

    def text(self) -> str:
        return self.template.format(**self.values())


def _normalised(text: str) -> str:
    # pages wrap lines at ~110 characters; a claim may span a line break
    return re.sub(r"\s+", " ", text)


def broken_claims(claims: Iterable[Claim]) -> list[str]:
    """One line per claim that its page does not state (or whose table no longer supports it)."""
    problems = []
    pages: dict[str, str] = {}
    for claim in claims:
        if claim.page not in pages:
            pages[claim.page] = _normalised((ROOT / claim.page).read_text())
        try:
            text = _normalised(claim.text())
        except ClaimBroken as error:
            problems.append(f"{claim.page}: {claim.template!r}: the committed table contradicts it: {error}")
            continue
        if text not in pages[claim.page]:
            problems.append(f"{claim.page}: expected the text {text!r} (from the committed table)")
    return problems


def check_claims(claims: Iterable[Claim]) -> None:
    """Fail naming every claim whose page and committed table disagree."""
    problems = broken_claims(claims)
    assert not problems, "documentation and committed tables disagree:\n" + "\n".join(problems)
