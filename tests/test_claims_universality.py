"""The numbers of docs/methods/universality.md ("Results", "What holds and what fails") rebuilt from the committed
tables of Shi 2024, Ch. 7 (benchmarks/results/universality/), each over every committed seed: a re-run that moves a
number, or a seed that contradicts a sentence ("in every seed", "the smallest m at which ..."), fails here."""
from __future__ import annotations

from doc_claims import Claim, check_claims, fmt, load, require, spread

PAGE = "docs/methods/universality.md"
C_TABLE = "benchmarks/results/universality/universality_c.json"
M_TABLE = "benchmarks/results/universality/universality_m.json"
TS = (2, 4, 8)
FLOOR = 0.0625           # label-noise variance: no probe can go below it
AGREE = 0.03             # "the errors agree": max - min over the three representations, as in the headline test


def _runs(T: int, mode: str) -> list[dict]:
    results = load(C_TABLE)["results"]
    return [results[seed][str(T)][mode] for seed in sorted(results, key=int)]


def _c(T: int, mode: str, group: str, key: str = "c") -> list[float]:
    return [run[key][group] for run in _runs(T, mode)]


def _sweeps() -> list[dict]:
    sweeps = load(M_TABLE)["sweeps"]
    return [sweeps[seed] for seed in sorted(sweeps, key=int)]


def _err(probe: str, rep: str, task: str, m: int) -> list[float]:
    return [s[probe][rep][task][str(m)] for s in _sweeps()]


def _ms() -> list[int]:
    return sorted(int(m) for m in _sweeps()[0]["errors"]["universal"]["target"])


def _seeds() -> list[str]:
    return sorted(load(M_TABLE)["sweeps"], key=int)


def _slash(values: list[list[float]], digits: int = 3) -> str:
    return " / ".join(spread(v, digits) for v in values)


def _universal_c():
    for T in TS:
        require(all(abs(c - 1 / T) < 0.01 for c in _c(T, "universal", "P_target")), f"universal c_P at T = {T}")
    return {"c": _slash([_c(T, "universal", "P_target") for T in TS])}


def _shared_and_spurious():
    s = [c for T in TS for mode in ("universal", "specific") for c in _c(T, mode, "S")]
    u = [c for T in TS for mode in ("universal", "specific") for c in _c(T, mode, "U")]
    return {"s": fmt(min(s)), "u": fmt(max(u), 4)}


def _specific():
    own = [c for T in TS for g in ("S", "P_target") for c in _c(T, "specific", g)]
    rest = [c for T in TS for g in ("P_other", "U") for c in _c(T, "specific", g)]
    return {"lo": fmt(min(own)), "hi": fmt(max(own)), "rest": fmt(max(rest))}


def _loss():
    gaps = [abs(run["loss"] / run["loss_theory"] - 1) for T in TS for mode in ("universal", "specific", "cr_closed")
            for run in _runs(T, mode)]
    return {"pct": f"{100 * max(gaps):.1f}"}


def _cr_closed():
    other = [_c(T, "cr_closed", "P_other") for T in TS]
    for T, values in zip(TS, other):
        require(all(abs(v - 1 / T) < 1e-3 for v in values), f"cr_closed keeps the other tasks at T = {T}: {values}")
    return {"c": _slash([_c(T, "cr_closed", "P_target") for T in TS]),
            "theory": " / ".join(fmt(_c(T, "cr_closed", "P_target", "c_theory")[0]) for T in TS),
            "other": _slash(other)}


def _cr_trained():
    return {"c": _slash([_c(T, "cr", "P_target") for T in TS]),
            "theory": _slash([_c(T, "cr", "P_target", "c_theory") for T in TS]),
            "other": _slash([_c(T, "cr", "P_other") for T in TS])}


def _bounds():
    b = [s["erm_bound"] for s in _sweeps()]
    return {"u": fmt(b[0]["universal"]["target"], 2), "st": fmt(b[0]["specific"]["target"], 2),
            "so": fmt(b[0]["specific"]["other"], 2), "cr": spread([x["cr"]["target"] for x in b], 2),
            "cro": fmt(b[0]["cr"]["other"], 2)}


def _erm_m8():
    tgt = {rep: _err("errors_erm", rep, "target", 8) for rep in ("universal", "specific", "cr")}
    oth = {rep: _err("errors_erm", rep, "other", 8) for rep in ("universal", "specific", "cr")}
    for i, u in enumerate(tgt["universal"]):
        require(u > tgt["specific"][i] and u > tgt["cr"][i], f"specific / CR beat universal on the target, seed {i}")
        require(oth["specific"][i] > max(oth["universal"][i], oth["cr"][i]), f"universal beats specific elsewhere, {i}")
    return {f"t_{rep}": spread(v) for rep, v in tgt.items()} | {f"o_{rep}": spread(v) for rep, v in oth.items()}


def _plateau():
    m = max(_ms())
    spec = _err("errors_erm", "specific", "other", m)
    rest = _err("errors_erm", "universal", "other", m) + _err("errors_erm", "cr", "other", m)
    require(min(spec) > 0.45 and max(rest) < 0.1, f"plateau: specific {spec}, others {rest}")
    return {"m": m, "spec": spread(spec), "lo": fmt(min(rest)), "hi": fmt(max(rest))}


def _disagreement(probe: str, m: int) -> list[float]:
    errs = [_err(probe, rep, "target", m) for rep in ("universal", "specific", "cr")]
    return [max(e) - min(e) for e in zip(*errs)]


def _agree():
    ms = _ms()
    ok = [m for m in ms if max(_disagreement("errors_erm", m)) <= AGREE]
    first = next(m for m in ms if all(m2 in ok for m2 in ms if m2 >= m))
    prev = ms[ms.index(first) - 1]
    late = [i for i, d in enumerate(_disagreement("errors_erm", prev)) if d > AGREE]
    require(bool(late), f"the target errors agree at m = {prev} in every seed: the page's m = {first} is too late")
    at = {rep: _err("errors_erm", rep, "target", prev) for rep in ("universal", "specific", "cr")}
    late_text = "; ".join(f"seed {_seeds()[i]}: universal {fmt(at['universal'][i])}, specific {fmt(at['specific'][i])}, "
                          f"CR {fmt(at['cr'][i])}" for i in late)
    return {"m": first, "tol": AGREE, "u": spread(_err("errors_erm", "universal", "target", first)),
            "s": spread(_err("errors_erm", "specific", "target", first)),
            "c": spread(_err("errors_erm", "cr", "target", first)), "prev": prev,
            "n": len(_seeds()) - len(late), "of": len(_seeds()), "late": late_text}


def _ridge():
    tgt = {rep: spread(_err("errors", rep, "target", 8)) for rep in ("universal", "specific", "cr")}
    oth = {rep: _err("errors", rep, "other", 8) for rep in ("universal", "specific")}
    require(all(s > u for s, u in zip(oth["specific"], oth["universal"])), "ridge: specific worse on the other task")
    return {"u": tgt["universal"], "s": tgt["specific"], "c": tgt["cr"], "os": spread(oth["specific"]),
            "ou": spread(oth["universal"])}


def _cka():
    pairs = ("universal vs specific", "universal vs cr", "specific vs cr")
    return dict(zip("abc", (spread([s["cka"][p] for s in _sweeps()], 2) for p in pairs)))


def _fit_errors():
    worst = lambda mode: max(max(abs(r["c"][g] - r["c_theory"][g]) for g in r["c"] if r["c_theory"][g] is not None)  # noqa: E731
                             for T in TS for r in _runs(T, mode))
    require(worst("cr_closed") < 1e-3, f"CR from the closed-form W* misses its theory by {worst('cr_closed')}")
    return {"us": fmt(max(worst("universal"), worst("specific")))}


def _shortfall():
    for T in (2, 4):
        require(all(c < t - 0.02 for c, t in zip(_c(T, "cr", "P_other"), _c(T, "cr", "P_other", "c_theory"))),
                f"CR from the trained W* takes from the other tasks at T = {T}")
    return {"t2": spread(_c(2, "cr", "P_other")), "t4": spread(_c(4, "cr", "P_other"))}


def _cap():
    require(all(abs(c - t) < 0.01 for c, t in zip(_c(8, "cr", "P_target"), _c(8, "cr", "P_target", "c_theory"))),
            "CR from the trained W* matches its theory at T = 8")
    return {f"t{T}": fmt(_c(T, "cr_closed", "P_target", "c_theory")[0], 2) for T in TS}


def _overlap():
    overlap = [run["overlap"] for T in TS for run in _runs(T, "universal")]
    return {"lo": fmt(min(overlap), 2), "hi": fmt(max(overlap), 2)}


def _ridge_no_plateau():
    m = max(_ms())
    spec = _err("errors", "specific", "other", m)
    require(max(spec) < 0.45, f"ridge: the trained specific representation plateaus after all: {spec}")
    return {"m": m, "v": spread(spec)}


def _gap():
    ms = _ms()
    gaps = {m: [u - s for u, s in zip(_err("errors_erm", "universal", "target", m),
                                      _err("errors_erm", "specific", "target", m))] for m in ms}
    peaks = [max(ms, key=lambda m: gaps[m][i]) for i in range(len(_seeds()))]
    require(all(p in (4, 8) and gaps[4][i] > 0.1 and gaps[8][i] > 0.1 for i, p in enumerate(peaks)),
            f"the gap peaks at m = 4 or 8 in every seed: {peaks}")
    closed = next(m for m in ms if all(max(abs(g) for g in gaps[m2]) <= AGREE for m2 in ms if m2 >= m))
    return {"n4": peaks.count(4), "of": len(peaks), "g4": spread(gaps[4], 2), "g8": spread(gaps[8], 2), "m": closed, "tol": AGREE}


CLAIMS = [Claim(PAGE, text, values) for text, values in [
    ("universal c_{{P_t}} = {c} at T = 2 / 4 / 8 (theory 0.5 / 0.25 / 0.125)", _universal_c),
    ("c_S >= {s} and c_U <= {u} at every T and seed", _shared_and_spurious),
    ("specific {lo}-{hi} on S and its task, <= {rest} elsewhere", _specific),
    ("the logistic loss on fresh pairs within {pct}% of its closed form", _loss),
    ("CR from the closed-form W*: c_{{P_target}} = {c} (theory {theory}), the other tasks {other}", _cr_closed),
    ("CR from the trained universal W*: {c} (theory from its start {theory}), the other tasks {other}", _cr_trained),
    ("B_{{phi,t}}: universal {u}, specific {st} on its task and {so} elsewhere, CR {cr} / {cro}", _bounds),
    ("target MSE at m = 8 universal {t_universal}, specific {t_specific}, CR {t_cr}; other task at m = 8 universal "
     "{o_universal}, CR {o_cr}, specific {o_specific}; in every seed universal is the worst on the target and specific the "
     "worst on the other task", _erm_m8),
    ("the specific representation's plateau {spec} at m = {m} (v2 + noise = 0.56) where the others reach the floor "
     "({lo}-{hi})", _plateau),
    ("The target errors agree (within {tol}) in every seed from m = {m} on: universal {u}, specific {s}, CR {c}. At "
     "m = {prev} they agree in {n} of {of} seeds, not in {late}", _agree),
    ("target at m = 8 universal {u}, specific {s}, CR {c}; other task specific {os} vs universal {ou}, specific worse "
     "in every seed", _ridge),
    ("Linear CKA universal vs specific {a}, universal vs CR {b}, specific vs CR {c}", _cka),
    ("max |c - theory| <= {us} at every T and seed, and CR from the closed-form W* within 0.001", _fit_errors),
    ("takes weight from the other tasks ({t2} vs 0.5 at T = 2, {t4} vs 0.25 at T = 4), in every seed", _shortfall),
    ("at T = 2 ({t2} + 0.50) and T = 4 ({t4} + 0.25), not at T = 8 ({t8} + 0.125), where the trained start matches "
     "theory too (within 0.01 in every seed)", _cap),
    ("from the closed-form W* everything matches to 0.001", _fit_errors),
    ("the specific representation's label efficiency on its task and its plateau on other tasks under the paper's "
     "norm-bounded probe, in every seed", lambda: _erm_m8() and _plateau() and {}),
    ("private overlap, the cosine of the smallest principal angle: {lo}-{hi} at every T and seed; 0 in the closed "
     "form", _overlap),
    ("does not plateau** on other tasks ({v} at m = {m})", _ridge_no_plateau),
    ("largest at m <= r in every seed (at m = 4 in {n4} of {of} seeds, at m = 8 in the others; {g4} at m = 4, {g8} at "
     "m = 8, for r = 10 under the norm-bounded probe) and within {tol} from m = {m} on", _gap),
]]


def test_universality_page_quotes_the_committed_tables():
    check_claims(CLAIMS)


if __name__ == "__main__":  # the rendered fragments, to paste into the page after a re-run
    for claim in CLAIMS:
        print(claim.text())
