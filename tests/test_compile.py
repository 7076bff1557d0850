"""``model.compile``: a run whose loss is under ``torch.compile`` ends where the eager run ends (to rounding),
through ``lightning fit``; ``null`` compiles only runs at least ``compile_pays_after`` steps long; a compile
that cannot run is refused before any work, naming the field."""
import pytest
import torch
from torch._dynamo.utils import counters

from test_seeds import _args
from featlearn.cli import main, make_cli
from featlearn.lightning_modules.mrp import TeacherStudentMRP

# float32 runs: the compiled kernels sum in another order (~1e-7 per step, a few steps); float64 ~1e-15
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-6), torch.float64: dict(rtol=1e-9, atol=1e-12)}


def _fit(key: str, out, compile: str, steps: int = 4):
    return make_cli([*_args(key, out, steps), "--model.init_args.compile", compile]).model


@pytest.mark.parametrize("key", ["mrp_teacher_student", *[pytest.param(k, marks=pytest.mark.slow) for k in (
    "mrp_mae", "contrastive", "noncontrastive", "noncontrastive_population", "vit_mae", "vit_cl", "two_layer",
    "universality")]])
def test_a_compiled_run_ends_where_the_eager_run_ends(key, tmp_path):
    eager = _fit(key, tmp_path / "eager", "false")
    counters.clear()
    compiled = _fit(key, tmp_path / "compiled", "true")
    assert compiled.compiled_loss in vars(compiled), "the loss was not replaced by its compiled form"
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert eager.compiled_loss not in vars(eager)
    for (name, want), got in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(got, want, **TOLERANCE[want.dtype], msg=lambda m: f"{key} {name}: {m}")


@pytest.mark.parametrize("steps, compiled", [(2, False), (4, True)])
def test_null_compiles_runs_long_enough_to_repay_it(steps, compiled, tmp_path, monkeypatch):
    monkeypatch.setattr(TeacherStudentMRP, "compile_pays_after", 3)
    model = _fit("mrp_teacher_student", tmp_path, "null", steps)
    assert (model.compiled_loss in vars(model)) == compiled


@pytest.mark.parametrize("key, argv, words", [
    ("mrp_teacher_student", ["--model.init_args.compile", "true", "--model.init_args.backend", "triton"],
     "model.compile: must be false or null with model.backend triton"),
    ("mrp_supervised", ["--model.init_args.compile", "true"],
     "model.compile: must be false or null: MultiViewClassifier offers no compiled loss"),
    ("noncontrastive_population", ["--model.init_args.compile", "true", "--seeds", "[1, 2]"],
     "model.compile: must be false or null with --seeds"),
])
def test_a_compile_that_cannot_run_is_refused(key, argv, words, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*_args(key, tmp_path), *argv])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "a run directory was created"
