"""Every experiment runs as ``__main__`` under a tool that executes it by name without becoming ``__main__`` itself
(``python -m cProfile -m featlearn.experiments.X``, ``runpy``): its settings types must resolve without
``sys.modules["__main__"]`` being the experiment's module."""
import runpy
import sys
from pathlib import Path

import pytest

import featlearn.experiments as experiments

ENTRY_POINTS = sorted(f.stem for f in Path(experiments.__path__[0]).glob("*.py")
                      if 'if __name__ == "__main__":' in f.read_text())


def test_the_entry_points_are_found():
    assert {"contrastive", "universality", "mrp", "noncontrastive", "two_layer"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_runs_as_main_under_another_main(name, monkeypatch, capsys):
    # what cProfile does: run_module(name, run_name="__main__") with sys.modules["__main__"] left as the tool
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"featlearn.experiments.{name}", run_name="__main__")
    assert done.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out
