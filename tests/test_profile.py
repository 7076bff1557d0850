"""`featlearn profile`: a trace of the recorded steps with the phases and op ranges, and its refusals."""
import json

import pytest

from featlearn.cli import main


def test_trace_has_every_phase_and_the_op(tmp_path, one_thread, capsys):
    out = tmp_path / "trace"
    main(["profile", "--config", "configs/mrp/teacher_student.yaml", "--steps", "2", "--skip", "1",
          "--out", str(out), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"])
    traces = list(out.glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = [e.get("name", "") for e in events]
    steps = {n for n in names if n.startswith("ProfilerStep#")}
    assert len(steps) == 2  # the skipped step is not recorded
    for phase in ("data", "forward+loss", "backward", "update", "metrics", "kernels.patch_activation_sum"):
        assert names.count(f"featlearn.{phase}") == 2, phase
    assert "featlearn.forward+loss" in capsys.readouterr().out


@pytest.mark.parametrize("argv, field", [(["--steps", "0"], "--steps"), (["--skip", "-1"], "--skip"),
                                         ([], "--config")])
def test_bad_options_are_refused_with_the_option_named(argv, field, capsys):
    config = [] if field == "--config" else ["--config", "configs/mrp/teacher_student.yaml"]
    with pytest.raises(SystemExit) as stop:
        main(["profile", *config, *argv] + (["--config", "nope.yaml"] if field == "--config" else []))
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {field}")
