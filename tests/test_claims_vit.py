"""The numbers of ``docs/methods/vit.md`` (Results, What holds and what fails) rebuilt from the committed tables
``benchmarks/results/vit/``: the main table (``vit_table.json``, p256_pos / p256_neg, 5 seeds), the small-area
preset (``p256_pos_small/vit_table.json``) and the MAE Delta sweep (``vit_delta.json``). Each table line of the
page is one claim; each sentence that says something of every seed checks it per seed with ``require``."""
from __future__ import annotations

from doc_claims import Claim, check_claims, fmt, load, require, spread

PAGE = "docs/methods/vit.md"
RESULTS = "benchmarks/results/vit"


def _rows(name: str) -> dict:
    return {(r["method"], r["point"]): r for r in load(f"{RESULTS}/{name}")}


def main() -> dict:
    return _rows("vit_table.json")


def small() -> dict:
    return _rows("p256_pos_small/vit_table.json")


def sweep() -> list[dict]:
    return sorted(load(f"{RESULTS}/vit_delta.json"), key=lambda r: r["delta_eff"])


def seeds(row: dict, key: str) -> list[float]:
    return [run[key] for run in row["per_seed"]]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _min_cell(row: dict) -> str:
    """``min (step) / end`` of phi_loc->glob; CL's never falls below its start 0 (checked in every seed)."""
    end = spread(seeds(row, "phi_local_to_global"), 2)
    if row["method"] == "cl":
        require(all(v == 0 for v in seeds(row, "phi_local_to_global_min")), "CL's phi_loc->glob never below 0")
        return f"never below 0 / {end}"
    steps = set(seeds(row, "phi_local_to_global_argmin_step"))
    require(steps == {row["steps"]}, f"the minimum at the last step in every seed: {steps}")
    return f"{spread(seeds(row, 'phi_local_to_global_min'), 2)} ({row['steps']}) / {end}"


def table_line(row: dict, label: str) -> str:
    """One line of the page's Results table."""
    expected = (fmt(row["per_seed"][0]["loss_floor_expected"], 4) if row["method"] == "mae"
                else fmt(row["loss_floor"], 3) + " (reference)")
    digits = 4 if row["method"] == "mae" else 3
    return " | ".join([
        f"| {label}", f"{spread(seeds(row, 'own_area_local'))} ({fmt(row['init_own_area_local'])})",
        spread(seeds(row, "own_area_global")),
        f"{spread(seeds(row, 'attn_global'))} ({fmt(row['init_attn_global'])})",
        spread(seeds(row, "final_loss"), digits),
        spread(seeds(row, "loss_floor"), digits) if row["method"] == "mae" else "-", expected,
        _min_cell(row), spread(seeds(row, "phi_local_own"), 2)]) + " |"


LABELS = {("mae", "p256_pos"): "MAE | p256_pos, +0.25", ("mae", "p256_neg"): "MAE | p256_neg, -0.25",
          ("cl", "p256_pos"): "CL | p256_pos, +0.25", ("cl", "p256_neg"): "CL | p256_neg, -0.25"}
SMALL_LABELS = {("mae", "p256_pos_small"): "MAE | p256_pos_small, +0.25",
                ("cl", "p256_pos_small"): "CL | p256_pos_small, +0.25"}


def sweep_lines() -> dict:
    rows = sweep()
    cells = {
        "delta": [f"{r['delta_eff']:+.2f}" if abs(r["delta_eff"]) > 1e-9 else "0" for r in rows],
        "dip": [spread(seeds(r, "phi_local_to_global_min"), 2) for r in rows],
        "theory": [f"{r['theory_dip']:.2f}" if r["theory_dip"] is not None else "" for r in rows],
        "own": [spread(seeds(r, "own_area_local")) for r in rows],
    }
    for r in rows:
        require(set(seeds(r, "phi_local_to_global_argmin_step")) == {r["steps"]}, f"{r['point']}: min not at the end")
    return {k: " | ".join(v) for k, v in cells.items()}


def _all_sweep(key: str) -> list[float]:
    return [v for r in sweep() for v in seeds(r, key)]


def own_local() -> dict:
    m = main()
    pos, neg = m["mae", "p256_pos"], m["mae", "p256_neg"]
    every = _all_sweep("own_area_local")
    return {"pos": spread(seeds(pos, "own_area_local")), "neg": spread(seeds(neg, "own_area_local")),
            "lo": fmt(min(every)), "hi": fmt(max(every)), "init": fmt(pos["init_own_area_local"]),
            "gpos": spread(seeds(pos, "own_area_global")), "gneg": spread(seeds(neg, "own_area_global")),
            "ipos": fmt(pos["init_attn_global"]), "ineg": fmt(neg["init_attn_global"]),
            "apos": spread(seeds(pos, "attn_global")), "aneg": spread(seeds(neg, "attn_global"))}


def mae_loss() -> dict:
    out = {}
    rows = {"pos": main()["mae", "p256_pos"], "neg": main()["mae", "p256_neg"],
            "small": small()["mae", "p256_pos_small"]}
    for name, row in rows.items():
        gaps = [run["final_loss"] - run["loss_floor"] for run in row["per_seed"]]
        require(min(gaps) >= -1e-6, f"{name}: a final loss below its batch's floor")
        out[f"{name}_loss"] = spread(seeds(row, "final_loss"), 4)
        out[f"{name}_floor"] = spread(seeds(row, "loss_floor"), 4)
        out[f"{name}_gap_hi"] = fmt(max(gaps), 4)
        out[f"{name}_expected"] = fmt(row["per_seed"][0]["loss_floor_expected"], 4)
    for name, row in rows.items():
        below = [run for run in row["per_seed"] if run["final_loss"] < run["loss_floor_expected"]]
        out[f"{name}_below"] = f"{len(below)} of {len(row['per_seed'])}"
    out["small_own"] = spread(seeds(rows["small"], "own_area_local"))
    out["small_glob"] = spread(seeds(rows["small"], "own_area_global"))
    return out


def cl_collapse() -> dict:
    m = main()
    out = {}
    for name, key in (("pos", "p256_pos"), ("neg", "p256_neg")):
        row = m["cl", key]
        require(all(run["own_area_local"] < run["init_own_area_local"] for run in row["per_seed"]),
                f"CL {key}: own local area does not fall in some seed")
        require(all(run["attn_global"] > run["init_attn_global"] + 0.05 for run in row["per_seed"]),
                f"CL {key}: no rise of the global-area attention in some seed")
        out[f"{name}_init"] = fmt(row["init_attn_global"])
        out[f"{name}_end"] = spread(seeds(row, "attn_global"))
        out[f"{name}_own"] = spread(seeds(row, "own_area_local"))
        out[f"{name}_loss"] = spread(seeds(row, "final_loss"))
    out["own_init"] = fmt(m["cl", "p256_pos"]["init_own_area_local"])
    # the held-out curves (every 10 steps): +0.25 stalls from step 50, -0.25 still rises over the last 50 steps
    pos = [dict(zip(r["curves"]["step"], r["curves"]["attn_glob_from_local"])) for r in m["cl", "p256_pos"]["per_seed"]]
    late = [v for c in pos for t, v in c.items() if t >= 50]
    out["stall_lo"], out["stall_hi"] = fmt(min(late)), fmt(max(late))
    neg = [r["curves"]["attn_glob_from_local"] for r in m["cl", "p256_neg"]["per_seed"]]
    rises = [c[-1] - c[-6] for c in neg]
    require(min(rises) > 0, "CL at -0.25 no longer rising at the end in some seed")
    out["rise_lo"], out["rise_hi"] = fmt(min(rises)), fmt(max(rises))
    same = [abs(r["own_area_global"] - r["attn_global"]) for k in ("p256_pos", "p256_neg")
            for r in m["cl", k]["per_seed"]]
    require(max(same) < 1e-6, "CL's global queries attend differently from local ones in some seed")
    out["ref"] = fmt(m["cl", "p256_pos"]["loss_floor"], 2)
    row = small()["cl", "p256_pos_small"]
    require(all(run["own_area_local"] < run["init_own_area_local"] for run in row["per_seed"]), "small CL own area")
    out["small"] = (f"{fmt(row['init_attn_global'])} -> {spread(seeds(row, 'attn_global'))}, own local area "
                    f"{fmt(row['init_own_area_local'])} -> {spread(seeds(row, 'own_area_local'))}")
    return out


def dip() -> dict:
    m = main()
    pos, neg = m["mae", "p256_pos"], m["mae", "p256_neg"]
    ratios = [p["phi_local_to_global_min"] / n["phi_local_to_global_min"]
              for p, n in zip(pos["per_seed"], neg["per_seed"])]
    require([p["seed"] for p in pos["per_seed"]] == [n["seed"] for n in neg["per_seed"]], "seeds differ")
    require(min(ratios) >= 2, f"the dip less than 2x deeper in some seed: {ratios}")
    rows = [r for r in sweep() if r["theory_dip"] is not None]
    below = {r["point"]: r["theory_dip"] - mean(seeds(r, "phi_local_to_global_min")) for r in rows}
    require(all(v > 0 for v in below.values()), "the plateau above the predicted level somewhere")
    dips = [mean(seeds(r, "phi_local_to_global_min")) for r in sweep()]
    require(all(b < a for a, b in zip(dips, dips[1:])), f"the dip does not deepen with Delta: {dips}")
    hi = max(rows, key=lambda r: r["delta_eff"])
    lo = min(rows, key=lambda r: r["delta_eff"])
    zero = next(r for r in sweep() if abs(r["delta_eff"]) < 1e-9)
    means = [(r["delta_eff"], mean(seeds(r, "phi_local_to_global_min"))) for r in sweep()]
    (d0, v0), (d1, v1) = means[0], next(m for m in means if abs(m[0]) < 1e-9)
    (d2, v2), (d3, v3) = means[-3], means[-1]
    return {"pos": spread(seeds(pos, "phi_local_to_global_min"), 2),
            "neg": spread(seeds(neg, "phi_local_to_global_min"), 2), "ratio": spread(ratios, 1),
            "below_hi": fmt(below[hi["point"]], 2), "d_hi": f"{hi['delta_eff']:.2f}",
            "below_lo": fmt(below[lo["point"]], 2), "d_lo": f"{lo['delta_eff']:.2f}",
            "zero": spread(seeds(zero, "phi_local_to_global_min"), 2),
            "slope_neg": fmt((v1 - v0) / (d1 - d0), 1), "slope_pos": fmt((v3 - v2) / (d3 - d2), 1),
            "d2": f"{d2:.2f}", "d3": f"{d3:.2f}", "own_neg": fmt(mean(seeds(neg, "phi_local_own")), 1),
            "bound": fmt(mean(seeds(neg, "phi_local_own")) / 256 ** 0.25, 1)}


def phases() -> dict:
    m = main()
    pos, neg = m["mae", "p256_pos"], m["mae", "p256_neg"]
    halves = _all_sweep("step_own_local_half")
    require(None not in halves, "a sweep run never reached half its attention on its own area")
    require(all(p["phi_local_to_global_early"] < n["phi_local_to_global_early"]
                for p, n in zip(pos["per_seed"], neg["per_seed"])), "the global correlation not faster at +0.25")
    early = _all_sweep("phi_local_own_early")
    return {"own_pos": spread(seeds(pos, "phi_local_own_early"), 2),
            "own_neg": spread(seeds(neg, "phi_local_own_early"), 2),
            "glob_pos": spread(seeds(pos, "phi_local_to_global_early"), 2),
            "glob_neg": spread(seeds(neg, "phi_local_to_global_early"), 2),
            "half_pos": spread(seeds(pos, "step_own_local_half"), 0),
            "half_neg": spread(seeds(neg, "step_own_local_half"), 0),
            "early_lo": fmt(min(early), 2), "early_hi": fmt(max(early), 2), "half_lo": f"{min(halves):.0f}", "half_hi": f"{max(halves):.0f}", "step": pos["early_step"]}


CLAIMS = [
    *(Claim(PAGE, "{line}", lambda key=key, label=label: {"line": table_line(main()[key], label)})
      for key, label in LABELS.items()),
    *(Claim(PAGE, "{line}", lambda key=key, label=label: {"line": table_line(small()[key], label)})
      for key, label in SMALL_LABELS.items()),
    Claim(PAGE, "MAE-only Delta sweep, seeds {seeds} ({wall} s,", lambda: {
        "seeds": " ".join(str(x) for x in sweep()[0]["seeds"]), "wall": f"{sweep()[0]['wall_s_total']:.0f}"}),
    Claim(PAGE, "| Delta | {delta} |", sweep_lines),
    Claim(PAGE, "| min phi_loc->glob (step 300 in every run) | {dip} |", sweep_lines),
    Claim(PAGE, "| theory -(Delta/2L) ln P, L = 0.9 (Delta > 0) | {theory} |", sweep_lines),
    Claim(PAGE, "| own-area attn, local queries | {own} |", sweep_lines),
    Claim(PAGE, "Masked local queries put {pos} (Delta = +0.25) and {neg} (-0.25) of their attention on the unmasked "
                "patches of their own area ({lo}-{hi} over every run of the sweep; {init} at init), global queries "
                "{gpos} / {gneg}; local queries' attention to the global area falls from {ipos} / {ineg} to {apos} "
                "/ {aneg}.", own_local),
    Claim(PAGE, "The final loss per masked patch is {pos_loss} (Delta = +0.25) and {neg_loss} (-0.25) against the "
                "floor of the same batch {pos_floor} / {neg_floor}, at most {pos_gap_hi} / {neg_gap_hi} above it in "
                "every seed, and below the expected floor {pos_expected} / {neg_expected} in {pos_below} / "
                "{neg_below} seeds", mae_loss),
    Claim(PAGE, "at p256_pos_small (C_s = 4, gamma = 0.5) own-area attention is {small_own} (local) / {small_glob} "
                "(global) and the loss is {small_loss} against its batch's floor {small_floor} (at most "
                "{small_gap_hi} above it in every seed) and below the expected floor {small_expected} in "
                "{small_below} seeds", mae_loss),
    Claim(PAGE, "Local queries' attention to the global area rises {pos_init} -> {pos_end} (Delta = +0.25) and "
                "{neg_init} -> {neg_end} (-0.25); their own local area falls {own_init} -> {pos_own} / {neg_own}",
          cl_collapse),
    Claim(PAGE, "with the loss at {pos_loss} against the reference {ref}", cl_collapse),
    Claim(PAGE, "(p256_pos_small: {small})", cl_collapse),
    Claim(PAGE, "from step 50 to 200 the held-out attention stays within {stall_lo}-{stall_hi} in every seed",
          cl_collapse),
    Claim(PAGE, "at Delta = -0.25 it is still rising at step 200 in every seed (+{rise_lo} to +{rise_hi} over the "
                "last 50 steps)", cl_collapse),
    Claim(PAGE, "({pos} vs {neg}, ratio {ratio} over seeds, at least 2 in every seed", dip),
    Claim(PAGE, "The plateau lies {below_hi} (Delta = {d_hi}) to {below_lo} (Delta = {d_lo}) below the predicted "
                "-(Delta/2L) ln P", dip),
    Claim(PAGE, "through Delta = 0 ({zero}) with no break", dip),
    Claim(PAGE, "its slope steepens from {slope_neg} per unit of Delta between -0.25 and 0 to {slope_pos} between "
                "{d2} and {d3}", dip),
    Claim(PAGE, "{own_neg} / 4 = {bound} at -0.25, satisfied", dip),
    Claim(PAGE, "the own correlation grows at the same rate for every Delta ({own_pos} at step {step} for Delta = "
                "+0.25, {own_neg} for -0.25, {early_lo}-{early_hi} over every run of the sweep", phases),
    Claim(PAGE, "local own-area attention reaches 0.5 at step {half_pos} (+0.25) and {half_neg} (-0.25) ({half_lo}-"
                "{half_hi} over every run of the sweep); the global correlation falls faster at +0.25 ({glob_pos} vs "
                "{glob_neg} at step {step})", phases),
]


def test_vit_page_states_the_committed_tables():
    check_claims(CLAIMS)

