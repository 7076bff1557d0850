"""``featlearn bench``: the smallest size of both commands runs end to end, every variant passes its float64
check and the tables are written; a wrong variant is refused and never timed; bad options are refused.
No timing is asserted (speed is what the benchmark reports, not what a test checks)."""
import csv
import re

import pytest
import torch

from featlearn.bench import harness
from featlearn.bench.cli import run
from featlearn.bench.ops import OPS, patch_case
from featlearn.cli import main


def _rows(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def _wrong(inputs):
    """patch_activation_sum's eager variant with the teacher at the wrong scale: off by far more than rounding."""
    s, t, q, gw = patch_case("smoke", torch.device("cpu")).variants[0].run(inputs)
    return s, 1.01 * t, q, gw


def test_op_smoke_checks_times_and_writes(tmp_path):
    wrong = patch_case("smoke", torch.device("cpu"))
    wrong.name = "patch_activation_sum (wrong teacher)"
    wrong.variants = [wrong.variants[0], harness.Variant("wrong", _wrong)]
    status, results, files = run(["op", "--size", "smoke", "--op", *OPS, "--repeats", "2",
                                  "--warmup", "1", "--device", "cpu", "--out", str(tmp_path)], extra_cases=[wrong])
    assert status == 1  # the injected variant failed
    assert sorted(f.name for f in files) == ["op_smoke_cpu.csv", "op_smoke_cpu.md", "op_smoke_cpu.png"]
    assert all(f.stat().st_size > 0 for f in files)
    bad = [r for r in results if r.variant == "wrong"]
    assert len(bad) == 1 and not bad[0].passed and bad[0].seconds == []  # refused and not timed
    good = [r for r in results if r.variant != "wrong"]
    assert {r.case for r in good} == {"patch_activation_sum (wrong teacher)", *OPS}
    assert all(r.passed and len(r.seconds) == 2 for r in good), [(r.case, r.variant, r.note) for r in good]
    rows = _rows(files[0])
    assert {r["variant"] for r in rows} >= {"eager", "compiled", "featlearn torch", "wrong"}
    assert [r["passed"] for r in rows if r["variant"] == "wrong"] == ["False"]
    # achieved rates from each case's own counts (no ceilings given: the shares stay empty)
    patch = [r for r in rows if r["case"] == "patch_activation_sum" and r["variant"] == "eager"][0]
    assert float(patch["gflop"]) == 4 * 12 * 5 * 24 * 7 / 1e9 and float(patch["tflops"]) > 0
    assert patch["precision"] == "ieee" and patch["frac_gemm_ceiling"] == "nan"
    assert "FAILED" in files[1].read_text()
    # `featlearn bench plot`: the PNG again from the CSV alone (how a GPU's tables get their figures)
    files[2].unlink()
    assert run(["plot", str(files[0])])[2] == [files[2]] and files[2].stat().st_size > 0


def test_plot_refuses_a_missing_table(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "plot", str(tmp_path / "missing.csv")])
    assert exit_.value.code == 2 and "CSV: no such file" in capsys.readouterr().err


# each compiled variant compiles twice per method (its check, then a cold compile for its timing): ~100 s
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_step_smoke_featlearn_matches_plain_loop(compiled, tmp_path):
    status, results, files = run(["step", "--size", "smoke", "--repeats", "2", "--warmup", "1", "--device", "cpu",
                                  *([] if compiled else ["--no-compile"]), "--out", str(tmp_path)])
    assert status == 0, [(r.case, r.variant, r.note) for r in results if not r.passed]
    assert {r.case for r in results} == {"mrp", "contrastive", "noncontrastive sample", "noncontrastive population",
                                         "vit_mae", "vit_cl", "two_layer", "universality"}
    for r in results:  # one step from the same weights and batch, in float64: the same weights
        # the plain loops also step (timed) beside the compiled module's run
        rounds = 2 if r.variant.startswith("featlearn") or not compiled else 4
        assert r.passed and r.error <= 1e-10 and len(r.seconds) == rounds, (r.case, r.variant, r.note)
    assert all(f.exists() for f in files)
    want = {"featlearn", "featlearn compiled", "eager", "compiled"} if compiled else {"featlearn", "eager"}
    assert {r["variant"] for r in _rows(files[0])} == want
    if compiled:
        assert all(re.match(r"compile \d+\.\d s, (repaid after \d+ steps|never repaid)$", r.note)
                   for r in results if r.variant == "featlearn compiled")


def test_step_seeds_in_one_run_are_checked_then_timed_per_seed_step(tmp_path):
    """``--seeds 3``: the first seed of three in one run takes the plain loop's step (float64), then is timed."""
    status, results, _ = run(["step", "--size", "smoke", "--method", "noncontrastive", "universality", "--seeds", "3",
                              "--repeats", "2", "--warmup", "1", "--device", "cpu", "--no-compile", "--out",
                              str(tmp_path)])
    assert status == 0, [(r.case, r.variant, r.note) for r in results if not r.passed]
    stacked = [r for r in results if r.variant == "featlearn x3"]
    assert {r.case for r in stacked} == {"noncontrastive sample", "noncontrastive population", "universality"}
    assert all(r.passed and r.error <= 1e-10 and len(r.seconds) == 2 for r in stacked)


def test_data_one_draw_is_checked_bit_for_bit_then_timed(tmp_path):
    """``bench data``: each seed stack's one draw against its seeds drawn in turn, exactly (tolerance 0)."""
    status, results, files = run(["data", "--size", "smoke", "--seeds", "2", "5", "--repeats", "2", "--warmup", "1",
                                  "--device", "cpu", "--out", str(tmp_path)])
    assert status == 0, [(r.case, r.variant, r.note) for r in results if not r.passed]
    one = [r for r in results if r.variant == "one draw"]
    assert {r.case for r in one} == {"universality x2", "universality x5", "contrastive x2", "contrastive x5"}
    assert all(r.passed and r.error == 0.0 and len(r.seconds) == 2 for r in one)
    assert [f.name for f in files] == ["data_smoke_cpu.csv", "data_smoke_cpu.md", "data_smoke_cpu.png"]


def test_a_zero_tolerance_is_bit_for_bit():
    """A variant's ``tolerance=0.0`` is kept (not the dtype's default): exact passes, one ulp off fails."""
    def nudged(inp):
        return (torch.nextafter(inp["x"], torch.full_like(inp["x"], float("inf"))),)
    variants = [harness.Variant("exact", lambda inp: (inp["x"].clone(),), tolerance=0.0),
                harness.Variant("ulp", nudged, tolerance=0.0), harness.Variant("ulp, default", nudged)]
    case = harness.Case("exact", "7", variants,
                        lambda dtype, dev, seed: {"x": torch.randn(7, generator=torch.Generator().manual_seed(seed))},
                        lambda inp: (inp["x"],))
    exact, ulp, default = harness.check(case, torch.device("cpu"), seed=3)
    assert exact.passed and exact.error == 0.0
    assert not ulp.passed and 0 < ulp.error < 1e-6 and default.passed


def test_lightning_fit_is_timed_from_its_own_logs(tmp_path, monkeypatch):
    """``--fit``: the case's settings fitted by the command in its own process, a sample per logged interval."""
    from featlearn.bench import user_fit
    monkeypatch.setattr(user_fit, "INTERVALS", 3)  # 300 steps of the smoke size: a few seconds
    status, results, _ = run(["step", "--size", "smoke", "--method", "universality", "--fit", "--repeats", "2",
                              "--warmup", "1", "--device", "cpu", "--no-compile", "--threads", "1", "--out",
                              str(tmp_path)])
    fit = next(r for r in results if r.variant == "lightning fit")
    assert status == 0 and fit.passed and fit.error <= 1e-10
    # logged every 25 steps from step 50 of 300 (Lightning's steps 74, 99, ..., 299): 9 intervals
    assert len(fit.seconds) == 9 and all(0 < s < 1 for s in fit.seconds)
    with pytest.raises(RuntimeError, match="lightning fit of universality/universal.yaml failed"):
        user_fit.fit_step_seconds("universality/universal.yaml", {"s": -1}, {}, 25)


def test_check_refuses_a_variant_that_writes_nan():
    case = patch_case("smoke", torch.device("cpu"))
    case.variants = [harness.Variant("nan", lambda inp: tuple(torch.full_like(o, float("nan"))
                                                               for o in case.variants[0].run(inp)))]
    (result,) = harness.check(case, torch.device("cpu"), seed=3)
    assert not result.passed and result.error == float("inf")


@pytest.mark.parametrize("argv, field", [
    (["bench", "op", "--size", "huge"], "--size"),
    (["bench", "op", "--op", "gemm"], "--op"),
    (["bench", "step", "--method", "mae"], "--method"),
    (["bench", "step", "--size", "medium"], "--size"),
    (["bench", "op", "--repeats", "0"], "--repeats"),
    (["bench", "op", "--size", "gpu", "--device", "cpu"], "--size"),
    (["bench", "op", "--size", "smoke", "--device", "cpu", "--ceilings", "missing.csv"], "--ceilings"),
    (["bench", "step", "--size", "smoke", "--fit", "--device", "cuda"], "--fit"),
    (["bench", "data", "--method", "mrp"], "--method"),
    (["bench", "data", "--size", "gpu"], "--size"),
    (["bench", "data", "--seeds", "0"], "--seeds"),
])
def test_bad_options_are_refused_naming_the_option(argv, field, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err
    assert not list(tmp_path.iterdir())  # refused before any work


def test_step_cases_take_the_main_jobs_configs():
    """The step cases read the methods' run configs (as `lightning fit --config` resolves them), so a changed
    config changes what the bench times; the gpu size is MRP's medium config and contrastive's medium size."""
    from featlearn.bench import step_methods, steps
    from featlearn.experiments.study import Run

    (mrp,) = step_methods.method("mrp", "tiny")
    config = Run("mrp/teacher_student.yaml", "mrp").resolved()
    assert mrp.data_args == config["data"]["init_args"] and mrp.model_args == config["model"]["init_args"]
    (two_layer,) = step_methods.method("two_layer", "tiny")
    assert two_layer.data_args["num_train"] == 5000 and two_layer.model_args["schedule"] == "plain"  # the noted changes
    medium, flops = steps.gpu_method("mrp")
    assert (medium.data_args["k"], medium.data_args["d"], medium.data_args["num_pretrain"], medium.model_args["m"]) == \
        (64, 1024, 16384, 8)
    assert flops == 4 * 16384 * 32 * 1024 * 64 * 8
    contrastive, _ = steps.gpu_method("contrastive")
    assert (contrastive.data_args["d"], contrastive.data_args["d1"], contrastive.model_args["lr"]) == (256, 2048, 1.0)



def test_reduce_overhead_is_offered_on_cuda_only():
    """Inductor's CUDA-graph mode is timed where it can pay (CUDA); a CPU run has no such row."""
    from featlearn.bench import step_methods, steps

    (spec,) = step_methods.method("universality", "smoke")
    names = {device: {v.name for v in steps.step_case(spec, torch.device(device)).variants}
             for device in ("cpu", "cuda")}
    assert names["cuda"] - names["cpu"] == {"featlearn reduce-overhead"}
    assert "featlearn compiled" in names["cpu"]
    no_compile = {v.name for v in steps.step_case(spec, torch.device("cuda"), compiled=False).variants}
    assert "featlearn reduce-overhead" not in no_compile


def test_compile_loss_passes_the_mode_on(monkeypatch):
    from featlearn.lightning_modules.universality import LinearContrastive

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    LinearContrastive().compile_loss()
    LinearContrastive().compile_loss(mode="reduce-overhead")
    assert calls == [{"backend": "inductor"}, {"backend": "inductor", "mode": "reduce-overhead"}]


@pytest.mark.slow  # an inductor compile (~10-20 s on this CPU)
def test_reduce_overhead_steps_equal_the_eager_module_steps_on_cpu():
    """The variant's float64 check on the CPU (CUDA graphs do not apply there; the compiled loss does): three
    steps, against the module's eager three, which differ from one step (so the check could fail)."""
    from featlearn.bench import step_methods, steps

    (spec,) = step_methods.method("universality", "smoke")
    cpu = torch.device("cpu")
    got = steps.featlearn_one_step(spec, 0, cpu, torch.float64, compiled="reduce-overhead", steps=steps.GRAPH_STEPS)
    want = steps.featlearn_one_step(spec, 0, cpu, torch.float64, steps=steps.GRAPH_STEPS)
    assert harness.relative_error(got, want) <= 1e-10
    assert harness.relative_error(steps.featlearn_one_step(spec, 0, cpu, torch.float64), want) > 1e-6


def test_a_variant_is_checked_against_its_own_reference_and_a_bare_exception_is_reported():
    one = lambda inputs: (torch.ones(3, dtype=torch.float64),)  # noqa: E731
    two = lambda inputs: (2 * torch.ones(3, dtype=torch.float64),)  # noqa: E731

    def bare(inputs):
        raise AssertionError()  # no message, as many of torch's internal asserts

    case = harness.Case("c", "", [harness.Variant("own", two, reference=two), harness.Variant("case's", two),
                                  harness.Variant("bare", bare)],
                        lambda dtype, dev, seed: {}, one, dtype=torch.float64)
    own, cases, raised = harness.check(case, torch.device("cpu"), 0)
    assert own.passed and not cases.passed
    assert not raised.passed and raised.note == "AssertionError: "


@pytest.mark.parametrize("plain_loop", [False, True])
def test_a_graphs_row_that_fails_while_timed_is_failed_and_the_bench_goes_on(monkeypatch, plain_loop):
    """A CUDA graph step that keeps an output fails only while timed: that row is FAILED, the others keep their
    times; a plain loop's failure is not blamed on it."""
    from featlearn.bench import step_methods, steps

    (spec,) = step_methods.method("universality", "smoke")
    real_fit = steps._fit

    def fit(model, dm, clock, *args):
        if clock.variant == steps.FEATLEARN_GRAPHS:
            raise steps.PlainLoopError("plain loop") if plain_loop else AssertionError()
        return real_fit(model, dm, clock, *args)

    monkeypatch.setattr(steps, "_fit", fit)
    results = [harness.Result(spec.name, "", v, 0.0, True) for v in (steps.FEATLEARN, steps.FEATLEARN_GRAPHS, "eager")]
    if plain_loop:
        with pytest.raises(steps.PlainLoopError):
            steps._timer(spec)(None, results, torch.device("cpu"), 2, 1, 0)
        return
    steps._timer(spec)(None, results, torch.device("cpu"), 2, 1, 0)
    featlearn, graphs, eager = results
    assert not graphs.passed and graphs.seconds == [] and graphs.peak_bytes is None
    assert graphs.note == "failed while timed: AssertionError: "
    assert featlearn.passed and len(featlearn.seconds) == 2 and len(eager.seconds) == 2
