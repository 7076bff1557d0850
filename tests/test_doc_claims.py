"""The claims mechanism itself (tests/doc_claims.py) catches a table that moved and a page that drifted."""
import json

import doc_claims
from doc_claims import Claim, broken_claims, require, spread


def _setup(tmp_path, monkeypatch, page_text, per_seed):
    monkeypatch.setattr(doc_claims, "ROOT", tmp_path)
    (tmp_path / "page.md").write_text(page_text)
    (tmp_path / "table.json").write_text(json.dumps({"acc": per_seed}))

    def values():
        acc = doc_claims.load("table.json")["acc"]
        require(min(acc) >= 0.9, f"a seed is below 0.9: {acc}")
        return {"acc": spread(acc)}

    return [Claim("page.md", "accuracy {acc}, at least 0.9 in every seed", values)]


def test_claim_in_step_passes(tmp_path, monkeypatch):
    claims = _setup(tmp_path, monkeypatch, "It reaches accuracy 0.950\n(0.920-0.980), at least 0.9 in every seed.",
                    [0.92, 0.95, 0.98])
    assert broken_claims(claims) == []


def test_a_rerun_that_moves_a_number_breaks_the_claim(tmp_path, monkeypatch):
    claims = _setup(tmp_path, monkeypatch, "accuracy 0.950 (0.920-0.980), at least 0.9 in every seed",
                    [0.92, 0.95, 0.99])
    (problem,) = broken_claims(claims)
    assert "0.953 (0.920-0.990)" in problem and "page.md" in problem


def test_a_seed_that_contradicts_the_sentence_breaks_it(tmp_path, monkeypatch):
    claims = _setup(tmp_path, monkeypatch, "accuracy 0.820 (0.500-0.980), at least 0.9 in every seed",
                    [0.5, 0.98, 0.98])
    (problem,) = broken_claims(claims)
    assert "contradicts" in problem and "below 0.9" in problem
