"""Typed experiment settings: an ``experiment.yaml`` or a sweep file read into a dataclass through jsonargparse,
so an unknown field, a missing one or a value of the wrong type is refused naming the field (and a YAML syntax
error naming its line). Used through :func:`featlearn.experiments.study.load_settings`."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from featlearn.errors import ConfigError


def load_settings(path: Path | str, cls: type, data: dict | None = None):
    """``path`` (YAML; or ``data`` already read from it) as a ``cls`` dataclass, through jsonargparse: an
    unknown field, a missing one or a value of the wrong type is a :class:`ConfigError` naming the field.

    Example:
        >>> from dataclasses import dataclass, field
        >>> @dataclass
        ... class Demo:
        ...     steps: int
        ...     seeds: list[int] = field(default_factory=lambda: [0])
        >>> load_settings("demo.yaml", Demo, {"steps": 5})
        Demo(steps=5, seeds=[0])
        >>> load_settings("demo.yaml", Demo, {"steps": "five"})
        Traceback (most recent call last):
        featlearn.errors.ConfigError: demo.yaml: steps: must be of type int, got 'five'
    """
    import yaml
    from jsonargparse import ArgumentParser, ArgumentError

    path = Path(path)
    if data is None:
        if not path.is_file():
            raise ConfigError(str(path), "an existing settings file", str(path))
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:  # its message holds the line and column
            mark = getattr(error, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            raise ConfigError(str(path), "valid YAML", f"{where}{getattr(error, 'problem', None) or error}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"a mapping of the fields of {cls.__name__}", data)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "settings")
    try:
        parsed = parser.parse_object({"settings": data})
    except ArgumentError as error:
        raise ConfigError(*_field_error(path, str(error))) from None
    return parser.instantiate(parsed).settings


def _field_error(path: Path, message: str) -> tuple[str, str, Any]:
    """(field, allowed, got) from a jsonargparse message such as ``Parser key "settings.steps": Expected a
    <class 'int'>. Got value: five`` or ``Group 'settings' does not accept option 'bogus'``."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = lines[0]
    if "does not accept option" in first:
        name = first.rsplit("'", 2)[-2].removeprefix("settings.")
        return f"{path}: {name}", "a known field", name
    if first.startswith('Parser key "'):
        name = first.split('"')[1].removeprefix("settings.").removeprefix("settings")
        expected = next((line for line in lines[1:] if line.startswith("Expected")), " ".join(lines[1:2]))
        got = expected.partition("Got value: ")[2] if "Got value: " in expected else " ".join(lines[1:])
        allowed = expected.partition(". Got value")[0].removeprefix("Expected a ").removeprefix("Expected ")
        allowed = re.sub(r"<class '(\w+)'>", r"of type \1", allowed)
        return f"{path}: {name or 'settings'}", allowed or "a valid value", got
    return str(path), "valid settings", " ".join(lines)[:300]
