"""Shi 2024, Chapter 9 (GemFilter: Shi, Ming, Nguyen, Liang, Joty, arXiv:2409.17422) as a mechanism test: does an early
layer's last query row find the needle of a long prompt, and does a second pass on the k tokens it selects answer?

Per seed, ``configs/gemfilter/retrieval.yaml`` trains a 4-layer decoder
(:class:`~featlearn.lightning_modules.retrieval_decoder.RetrievalDecoder`) on key-value retrieval
(:class:`~featlearn.datamodules.kv_retrieval.KVRetrievalDataModule`: training prompts of 96 tokens, test prompts of
512 with the needle at depths 0, 0.1, ..., 1). Then at every filter layer r (0-based) and budget k it measures on
the test prompts: the share of the needle's two tokens selected (recall), the second pass's answer (GemFilter as
the chapter runs it, and with the two question tokens always kept, our addition), GemFilter-One-Run, and the
ablations that select with the middle query row or the row of largest l2 norm. The prompt phase (layers
``0 .. r - 1`` and layer r's projections, then the selection) is timed against the full pass that keeps every
layer's key-value cache (one prompt, one CPU thread, median of repeats); its memory is the peak of the bytes held
by live tensors (counted op by op with a dispatch mode; parameters apart, the layers' weights it reads added).
A layer-choice rule (ours): the smallest r whose recall at ``--rule-budget`` on held-out validation prompts is
within ``--tolerance`` of the best layer's; does it pick the layer that is best on the test prompts?

Usage::

    python -m featlearn.experiments.gemfilter --seed 0 1 2 [--steps 600] [--budgets 16 32 64 128]
"""
from __future__ import annotations

import os
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from featlearn.datamodules.kv_retrieval import KVRetrievalDataModule
from featlearn.experiments.common import (checked, experiment_parser, markdown_table, mean_range,
                                          parse_experiment_args, quiet_lightning)
from featlearn.experiments.study import Run, Study
from featlearn.lightning_modules.retrieval_decoder import needle_hits
from featlearn.metrics.figures import curves_figure

DEPTHS = [i / 10 for i in range(11)]
CHUNK, QUESTION = 64, 2  # prompts per forward; the question's tokens (QUERY, K*) kept by "+ question"
VARIANTS = ("gemfilter", "question_kept", "one_run", "middle_row", "largest_l2_row")


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that ops create while the mode is on (storages counted once: views
    and in-place results share them; tensors made before, such as parameters, not counted).

    Example:
        >>> with LiveBytes() as mode:
        ...     a = torch.ones(1000)           # 4000 bytes
        ...     b = (a * 2).view(10, 100)      # 4000 more, the view on the product's storage
        ...     del a
        >>> mode.peak, mode.now
        (8000, 4000)
    """

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.refs: dict[int, int] = {}

    def _free(self, key: int, size: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if key not in self.refs and key in given:
                continue  # a view of a tensor made outside the mode
            if key not in self.refs:
                self.refs[key] = 0
                self.now += size
                self.peak = max(self.peak, self.now)
            self.refs[key] += 1
            weakref.finalize(t, self._free, key, size)
        return out


def efficiency(model, tokens: torch.Tensor, k: int, repeats: int) -> dict:
    """Prompt phase of each filter layer (and GemFilter with its second pass) against the full pass, one prompt:
    seconds (the calls interleaved, ``repeats`` rounds; ratios are medians of each round's ratio, so that a
    neighbour's load shifts both sides) and peak bytes (:class:`LiveBytes` plus the weights of the blocks read)."""
    layers, n = len(model.blocks), tokens.shape[1]
    weights = lambda blocks: sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    embed = model.embedding.weight.numel() * model.embedding.weight.element_size()

    def full():
        h, cache = model.run(tokens, keep="kv")  # the prefill of standard attention keeps every layer's cache
        return model.head(model.norm(h[:, -1])), cache

    def prompt(r):
        q, keys = model.prefix(tokens, r, every=False)[r]
        return model.select(q, keys, k)

    calls = {"full": full, **{r: (lambda r=r: prompt(r)) for r in range(layers)},
             **{f"gemfilter{r}": (lambda r=r: model.second_pass(tokens, prompt(r))) for r in range(layers)}}
    seconds, peak = {key: [] for key in calls}, {}
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first round warms up and is dropped
            for key, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[key].append(time.perf_counter() - start)
        for key, call in calls.items():
            with LiveBytes() as mode:
                kept = call()
                del kept
            peak[key] = mode.peak
    ratio = lambda key: statistics.median(a / b for a, b in zip(seconds[key][1:], seconds["full"][1:]))
    out = {"full": {"seconds": statistics.median(seconds["full"][1:]), "tokens": n,
                    "bytes": peak["full"] + embed + weights(model.blocks)}}
    for r in range(layers):
        held = peak[r] + embed + weights(model.blocks[:r + 1])
        out[r] = {"seconds": statistics.median(seconds[r][1:]), "bytes": held, "time_ratio": ratio(r),
                  "gemfilter_time_ratio": ratio(f"gemfilter{r}"), "memory_ratio": held / out["full"]["bytes"]}
    return out


def scores(model, batch: dict, budgets: list[int]) -> dict:
    """Per (layer, budget): recall of the needle (last row), the share selecting both its tokens, the question's
    last token kept, and the answer accuracy of each variant; plus the full pass's accuracy and, per depth, the
    last row's recall."""
    layers, sums, total = len(model.blocks), {}, len(batch["tokens"])
    by_depth = {}
    full_right = 0.0
    for s in range(0, total, CHUNK):
        tokens, needle, answer = (batch[key][s:s + CHUNK] for key in ("tokens", "needle", "answer"))
        depth = batch["depth"][s:s + CHUNK]
        with torch.no_grad():  # one full pass: every layer's queries and keys, the cache One-Run evicts, the answer
            h, record = model.run(tokens, keep="qkvh")
            prefix, cache = {r: (q, k) for r, (q, k, _, _) in enumerate(record)}, [rec[1:] for rec in record]
            full_right += float((model.head(model.norm(h[:, -1])).argmax(-1) == answer).sum())
        for r in range(layers):
            for k in budgets:
                row = sums.setdefault(f"r{r}_k{k}", {})
                runs = {"gemfilter": {}, "question_kept": {"keep_last": QUESTION}, "one_run": {"one_run": True},
                        "middle_row": {"row": "middle"}, "largest_l2_row": {"row": "largest_l2"}}
                add = lambda key, right: row.__setitem__(key, row.get(key, 0.0) + float(right.sum()))
                for name, options in runs.items():
                    out = model.gemfilter(tokens, r, k, needle=needle, prefix=prefix, cache=cache, **options)
                    add(f"{name}_accuracy", out["logits"].argmax(-1) == answer)
                    if name in ("gemfilter", "middle_row", "largest_l2_row"):
                        add(f"{name}_recall", out["recall"])
                    if name == "gemfilter":
                        idx = out["indices"]
                        add("both", needle_hits(idx, needle).all(1))
                        add("question_kept", idx[:, -1] == tokens.shape[1] - 1)
                        for d in depth.unique().tolist():
                            cell = by_depth.setdefault(f"r{r}_k{k}", {}).setdefault(f"{d:.1f}", [0.0, 0])
                            cell[0] += float(out["recall"][depth == d].sum())
                            cell[1] += int((depth == d).sum())
    out = {key: {name: v / total for name, v in row.items()} for key, row in sums.items()}
    out["full_accuracy"] = full_right / total
    out["recall_by_depth"] = {key: {d: s / c for d, (s, c) in cells.items()} for key, cells in by_depth.items()}
    return out


def layer_rule(model, batch: dict, k: int, tolerance: float) -> tuple[int, list[float]]:
    """The smallest filter layer whose recall at budget ``k`` on ``batch`` is within ``tolerance`` of the best."""
    with torch.no_grad():
        prefix = model.prefix(batch["tokens"], len(model.blocks) - 1)
        recall = [float(model.gemfilter(batch["tokens"], r, k, needle=batch["needle"], prefix=prefix)["recall"].mean())
                  for r in range(len(model.blocks))]
    return next(r for r, v in enumerate(recall) if v >= max(recall) - tolerance), recall


def evaluate(fitted, args) -> dict:
    model, base = fitted.model.eval(), data_args(fitted.datamodule)
    test = KVRetrievalDataModule(**base, eval_depths=DEPTHS, num_test=args.prompts).batch(torch.arange(args.prompts),
                                                                                          "test")
    held_out = KVRetrievalDataModule(**base, num_val=args.held_out).batch(torch.arange(args.held_out), "val")
    pick, rule_recall = layer_rule(model, held_out, args.rule_budget, args.tolerance)
    return {**scores(model, test, args.budgets), "rule_pick": pick, "rule_recall": rule_recall,
            "efficiency": {str(key): v for key, v in efficiency(model, test["tokens"][:1], args.timing_budget,
                                                                args.repeats).items()}}


def data_args(data: KVRetrievalDataModule) -> dict:
    return dict(context=data.context, train_context=data.train_context, pairs=data.pairs, queries=data.queries,
                fillers=data.fillers, keys=data.keys, values=data.values, seed=data.seed)


def best_layer(result: dict, layers: int, k: int, metric: str) -> int:
    return max(range(layers), key=lambda r: (result[f"r{r}_k{k}"][metric], -r))


def tables(results: dict[int, dict], layers: int, budgets: list[int], main_k: int, tolerance: float) -> str:
    """The recall table (layer x budget), the main budget's variants, the efficiency, the layer rule."""
    runs = list(results.values())
    cell = lambda r, k, key: mean_range([x[f"r{r}_k{k}"][key] for x in runs])
    recall = markdown_table({f"layer {r}": {f"k = {k}": cell(r, k, "gemfilter_recall") for k in budgets}
                             for r in range(layers)}, [f"k = {k}" for k in budgets])
    columns = {"recall": "gemfilter_recall", "both tokens": "both", "question kept": "question_kept",
               "GemFilter acc.": "gemfilter_accuracy", "+ question acc.": "question_kept_accuracy",
               "One-Run acc.": "one_run_accuracy", "middle-row recall": "middle_row_recall",
               "middle-row acc.": "middle_row_accuracy", "l2-row recall": "largest_l2_row_recall",
               "l2-row acc.": "largest_l2_row_accuracy"}
    variants = markdown_table({f"layer {r}": {c: cell(r, main_k, key) for c, key in columns.items()}
                               for r in range(layers)}, list(columns))
    eff = lambda r, key: mean_range([x["efficiency"][str(r)][key] for x in runs])
    columns = ["prompt phase time / full", "+ second pass", "memory / full", "blocks run / all"]
    costs = markdown_table({f"layer {r}": dict(zip(columns, (eff(r, "time_ratio"), eff(r, "gemfilter_time_ratio"),
                                                             eff(r, "memory_ratio"), f"{r}/{layers} + projections")))
                            for r in range(layers)}, columns)
    rule = {}
    for seed, x in results.items():
        best = {k: best_layer(x, layers, k, "question_kept_accuracy") for k in budgets}
        picked = x[f"r{x['rule_pick']}_k{main_k}"]["question_kept_accuracy"]
        top = x[f"r{best[main_k]}_k{main_k}"]["question_kept_accuracy"]
        rule[f"seed {seed}"] = {"rule's layer": x["rule_pick"], "held-out recall per layer": " / ".join(
            f"{v:.2f}" for v in x["rule_recall"]), **{f"best at k = {k}": best[k] for k in budgets},
            f"its acc. - best (k = {main_k})": f"{picked - top:+.3f}"}
    rule_table = markdown_table(rule, ["rule's layer", "held-out recall per layer",
                                       *[f"best at k = {k}" for k in budgets], f"its acc. - best (k = {main_k})"])
    return (f"## Recall of the needle (last row), filter layer (0-based) x budget\n\n{recall}\n\n"
            f"## Budget k = {main_k}: GemFilter, its variants and the ablations\n\n{variants}\n\n"
            f"## Prompt phase against the full pass with its cache (one prompt of "
            f"{runs[0]['efficiency']['full']['tokens']} tokens)"
            f"\n\n{costs}\n\n## Layer rule: smallest r within {tolerance:g} of the best held-out recall\n\n"
            f"{rule_table}")


def claims(results: dict[int, dict], layers: int, main_k: int) -> str:
    """The chapter's claims beside the measurements (mean over seeds; the best layer by GemFilter + question)."""
    runs = list(results.values())
    mean = lambda key, r: sum(x[f"r{r}_k{main_k}"][key] for x in runs) / len(runs)
    per_layer = lambda key: " / ".join(f"{mean(key, r):.2f}" for r in range(layers))
    best = max(range(layers), key=lambda r: mean("question_kept_accuracy", r))
    middle = range(1, layers - 1)
    cost = lambda key: " / ".join(f"{sum(x['efficiency'][str(r)][key] for x in runs) / len(runs):.2f}"
                                  for r in range(layers))
    rows = {
        "a middle layer suffices (Table 9.2: LLaMA 3.1 layers 13-25 of 32 within 0.6 of the best 34.50, layer 1 23.50)":
            f"+ question acc. by layer {per_layer('question_kept_accuracy')}; best layer {best}; middle layers "
            f"{', '.join(map(str, middle))} at most {max(mean('question_kept_accuracy', r) for r in middle):.2f}",
        "the needle is found by early-middle layers (Fig. 9.5)": f"recall by layer {per_layer('gemfilter_recall')}",
        "the last row is essential (NIAH: GemFilter 0.838, Middle-Row 0.198, Largest-l2-Row 0.125)":
            f"layer {best}: recall last / middle / l2 row {mean('gemfilter_recall', best):.2f} / "
            f"{mean('middle_row_recall', best):.2f} / {mean('largest_l2_row_recall', best):.2f}; acc. "
            f"{mean('gemfilter_accuracy', best):.2f} / {mean('middle_row_accuracy', best):.2f} / "
            f"{mean('largest_l2_row_accuracy', best):.2f}",
        "One-Run is close to GemFilter (NIAH: 0.827 vs 0.838)":
            f"layer {best}: One-Run {mean('one_run_accuracy', best):.2f}, GemFilter "
            f"{mean('gemfilter_accuracy', best):.2f}, + question {mean('question_kept_accuracy', best):.2f}",
        "the selection keeps the question (Fig. 9.1)": f"last token kept by layer {per_layer('question_kept')}",
        "prompt phase below the full pass, Theta(r) of Theta(m) (Thm 9.3)":
            f"time / full by layer {cost('time_ratio')}; memory / full {cost('memory_ratio')}",
    }
    table = markdown_table({k: {"measured": v} for k, v in rows.items()}, ["measured"])
    return table.replace("| setting |", "| claim |")


def figures(results: dict[int, dict], layers: int, budgets: list[int], main_k: int) -> dict:
    runs = list(results.values())
    x = list(range(layers))
    recall = curves_figure(x, {f"k = {k}": [[r[f"r{i}_k{k}"]["gemfilter_recall"] for i in x] for r in runs]
                               for k in budgets}, xlabel="filter layer r (0-based)", ylabel="recall of the needle",
                           title="GemFilter's selection by filter layer")
    names = {"GemFilter": "gemfilter_accuracy", "+ question kept": "question_kept_accuracy",
             "One-Run": "one_run_accuracy", "middle row": "middle_row_accuracy",
             "largest-l2 row": "largest_l2_row_accuracy"}
    series = {n: [[r[f"r{i}_k{main_k}"][key] for i in x] for r in runs] for n, key in names.items()}
    series["full pass"] = [[r["full_accuracy"]] * layers for r in runs]
    accuracy = curves_figure(x, series, xlabel="filter layer r (0-based)", ylabel=f"answer accuracy (k = {main_k})",
                             title="second pass on the selected tokens")
    depths = sorted(runs[0]["recall_by_depth"][f"r0_k{main_k}"], key=float)
    by_depth = curves_figure([float(d) for d in depths], {f"layer {i}": [[r["recall_by_depth"][f"r{i}_k{main_k}"][d]
                                                                           for d in depths] for r in runs] for i in x},
                             xlabel="needle depth", ylabel=f"recall (k = {main_k})", title="recall by needle depth")
    return {"recall": recall, "accuracy": accuracy, "depth": by_depth}


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__.split("\n")[0], "runs/gemfilter")
    positive = checked(int, lambda v: v >= 1, "an integer >= 1")
    parser.add_argument("--steps", type=positive, default=600, help="training steps per seed (default 600)")
    parser.add_argument("--budgets", type=positive, nargs="+", default=[16, 32, 64, 128], help="budgets k")
    parser.add_argument("--main-budget", type=positive, default=32, help="the budget of the variants' table")
    parser.add_argument("--prompts", type=positive, default=256, help="test prompts (cycling the depth grid)")
    parser.add_argument("--held-out", type=positive, default=64, help="validation prompts of the layer rule")
    parser.add_argument("--rule-budget", type=positive, default=16, help="the layer rule's budget (default 16)")
    parser.add_argument("--tolerance", type=checked(float, lambda v: 0 <= v <= 1, "in [0, 1]"), default=0.05)
    parser.add_argument("--timing-budget", type=positive, default=32, help="k of the timed prompt phase")
    parser.add_argument("--repeats", type=positive, default=30, help="timed rounds (median; default 30)")

    def check(parser, args):
        context = 512  # configs/gemfilter/data_512.yaml
        for name, values in (("--budgets", args.budgets), ("--rule-budget", [args.rule_budget]),
                             ("--timing-budget", [args.timing_budget])):
            if max(values) > context:
                parser.error(f"{name}: budgets must be at most the context's {context} tokens, got {max(values)}")
        if args.main_budget not in args.budgets:
            parser.error(f"--main-budget: must be one of --budgets {args.budgets}, got {args.main_budget}")
    args = parse_experiment_args(parser, argv, check)
    quiet_lightning()
    t0, load0 = time.time(), os.getloadavg()[0]
    with Study(args, "seeds", fits=len(args.seed)) as study:
        results = {seed: study.fit(Run("gemfilter/retrieval.yaml", f"seed{seed}", {
            "trainer.max_steps": args.steps, "trainer.val_check_interval": args.steps,
            "heatmap.every_n_steps": args.steps}, seed=seed), lambda fitted: evaluate(fitted, args))
                   for seed in args.seed}
    layers = len(results[args.seed[0]]["rule_recall"])
    notes = (f"Seeds {' '.join(map(str, args.seed))} (mean (min-max) over seeds): a 4-layer decoder trained "
             f"{args.steps} steps of 32 prompts of 96 tokens; {args.prompts} test prompts of 512 tokens, needle depths "
             f"0, 0.1, ..., 1. Full pass accuracy {mean_range([r['full_accuracy'] for r in results.values()])}. "
             f"Recall: share of the needle's two tokens selected. '+ question': the last {QUESTION} tokens always kept "
             f"(ours). Time: median of {args.repeats} interleaved rounds, one thread, k = {args.timing_budget}; memory: "
             f"peak live tensor bytes plus the weights read. Wall time {time.time() - t0:.0f} s, load average {load0:.1f} -> {os.getloadavg()[0]:.1f} "
             f"on {os.cpu_count()} cores.")
    text = (f"## The chapter's claims (k = {args.main_budget})\n\n{claims(results, layers, args.main_budget)}\n\n"
            + tables(results, layers, args.budgets, args.main_budget, args.tolerance))
    study.write("gemfilter", {"results": {str(s): r for s, r in results.items()}, "notes": notes},
                f"# Shi 2024, Chapter 9: GemFilter on a trained 4-layer decoder\n\n{notes}\n\n{text}",
                figures(results, layers, args.budgets, args.main_budget))
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
