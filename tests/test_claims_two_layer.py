"""docs/methods/two_layer.md quotes the committed Tables A.1-A.3 (benchmarks/results/two_layer/): every row of
each committed table is on the page verbatim, and each sentence that quotes a number or a per-seed statement
is rebuilt from the JSON (tests/doc_claims.py)."""
import pytest

from doc_claims import ROOT, Claim, check_claims, load, require, spread

PAGE = "docs/methods/two_layer.md"
RESULTS = "benchmarks/results/two_layer"


def table_rows(table: str) -> list[str]:
    """The markdown table rows of a committed table (header and separator lines excluded)."""
    lines = (ROOT / RESULTS / f"two_layer_{table}.md").read_text().splitlines()
    return [line for line in lines if line.startswith("| ") and not line.startswith("| row ")]


def per_seed(table: str, setting: str, column: str, key: str) -> list[float]:
    return [r[key] for r in load(f"{RESULTS}/two_layer_{table}.json")["results"][setting][column]["per_seed"].values()]


@pytest.mark.parametrize("table", ["A1", "A2", "A3"])
def test_the_page_copies_every_row_of_the_committed_table(table):
    check_claims([Claim(PAGE, row.replace("{", "{{").replace("}", "}}"), dict) for row in table_rows(table)])


def _network_fits_the_parity(table, setting):
    def values():
        seeds = load(f"{RESULTS}/two_layer_{table}.json")["results"][setting]["Network"]["per_seed"]
        require(all(r["test"] == 100.0 and r["train"] == 100.0 for r in seeds.values()),
                f"Network below 100% at a seed of {table} {setting}")
        return {"n": len(seeds)}
    return values


CLAIMS = [
    Claim(PAGE, "network fits the parity exactly at every one of the {n} seeds of Table A.1",
          _network_fits_the_parity("A1", "parity d=500")),
]


def test_sentences_quote_the_committed_tables():
    check_claims(CLAIMS)


def _a1(column, key="test", digits=1):
    return lambda: {"v": spread(per_seed("A1", "parity d=500", column, key), digits)}


def _interval_network_split():
    tests = dict(zip(load(f"{RESULTS}/two_layer_A2.json")["results"]["interval d=500"]["Network"]["per_seed"],
                     per_seed("A2", "interval d=500", "Network", "test")))
    exact = [s for s, t in tests.items() if t == 100.0]
    rest = [s for s, t in tests.items() if t != 100.0]
    require(all(55 <= tests[s] <= 62 for s in rest), f"a seed is neither exact nor at the majority class: {tests}")
    words = lambda seeds: ", ".join(seeds[:-1]) + " and " + seeds[-1] if len(seeds) > 1 else seeds[0]
    return {"exact": words(exact), "rest": words(rest)}


def _margin_over_fixed_features():
    network = per_seed("A1", "parity d=500", "Network", "test")
    fixed = [max(n, r) for n, r in zip(per_seed("A1", "parity d=500", "NTK", "test"),
                                      per_seed("A1", "parity d=500", "RF", "test"))]
    require(min(a - b for a, b in zip(network, fixed)) > 15, "the Network's margin is 15 points or less at a seed")
    return {}


def _stops(column):
    def values():
        stops = [r["stop"] for r in load(f"{RESULTS}/two_layer_A1.json")["results"]["parity d=500"][column]
                 ["per_seed"].values()]
        return {"lo": min(stops), "hi": max(stops)}
    return values


SENTENCES = [
    Claim(PAGE, "reaches {v} test (paper 86.4)", _a1("NTK")),
    Claim(PAGE, "kept at global steps {lo}-{hi} of", _stops("NTK")),
    Claim(PAGE, "Network's margin over the fixed features is more than 15 points on every seed",
          _margin_over_fixed_features),
    Claim(PAGE, "RF reaches {v} (paper 76.0)", _a1("RF")),
    Claim(PAGE, "the NTK ({v}), each stopped at its best step", _a1("NTK")),
    Claim(PAGE, "(Two Step {v} test over seeds 0-4)", _a1("Two Step")),
    Claim(PAGE, "the network itself fits it ({v})", _a1("Network")),
    Claim(PAGE, "(RF {v})", _a1("RF")),
    Claim(PAGE, "(Cos {v},", _a1("w/o structure", "cos", 3)),
    Claim(PAGE, "test {v}).", _a1("w/o structure")),
    Claim(PAGE, "fits it exactly on seeds {exact} and stays at the majority class (~58%) on seeds {rest}",
          _interval_network_split),
    Claim("README.md", "the network fits the parity, {v} % test over seeds 0-4 (paper 100), against", _a1("Network")),
    Claim("README.md", "against {v} for the NTK", _a1("NTK")),
    Claim("README.md", "`make two-layer` | {s} s (Table A.1", lambda: {"s": round(load(
        f"{RESULTS}/two_layer_A1.json")["meta"]["wall_s"])}),
]


def _a3(column):
    def values():
        small, large = (spread(per_seed("A3", f"parity d={d}", column, "test"), 1) for d in (100, 2000))
        return {"small": small, "large": large}
    return values


def _a3_fits_everywhere():
    for d in (100, 2000):
        require(all(t == 100.0 for t in per_seed("A3", f"parity d={d}", "Network", "test")),
                f"Network below 100% at a seed of A3 d={d}")
    return {}


SENTENCES += [
    Claim(PAGE, "the NTK at {small} and {large}", _a3("NTK")),
    Claim(PAGE, "RF at {small} and {large} (paper 78.3 and 77.0)", _a3("RF")),
    Claim(PAGE, "the network fits the parity on every seed at d = 100 and at", _a3_fits_everywhere),
]


def test_page_and_readme_sentences_quote_the_committed_tables():
    check_claims(SENTENCES)
