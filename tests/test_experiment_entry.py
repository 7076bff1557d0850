"""Every experiment runs as ``__main__`` under a tool that executes it by name without becoming ``__main__`` itself
(``python -m cProfile -m featlearn.experiments.X``, ``runpy``): its settings must load as they do on import, nested
dataclasses included (see :func:`featlearn.experiments.settings.load_settings`)."""
import importlib
import runpy
import sys
from pathlib import Path

import pytest

import featlearn.experiments as experiments
import featlearn.experiments.study as study

ENTRY_POINTS = sorted(f.stem for f in Path(experiments.__path__[0]).glob("*.py")
                      if 'if __name__ == "__main__":' in f.read_text())


def test_the_entry_points_are_found():
    assert {"contrastive", "universality", "mrp", "noncontrastive", "two_layer", "erm_nu"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_settings_load_as_on_import_when_run_under_another_main(name, monkeypatch, capsys):
    imported = getattr(importlib.import_module(f"featlearn.experiments.{name}"), "SETTINGS", None)
    loaded, real = [], study.load_settings
    monkeypatch.setattr(study, "load_settings", lambda *args, **kwargs: loaded.append(real(*args, **kwargs)) or
                        loaded[-1])
    # what cProfile does: run_module(name, run_name="__main__") with sys.modules["__main__"] left as the tool
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"featlearn.experiments.{name}", run_name="__main__")
    assert done.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out
    if loaded:  # the same values and the same nested dataclasses (a field read as a plain dict prints otherwise)
        assert [repr(s) for s in loaded] == [repr(imported)]
