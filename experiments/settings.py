"""Typed experiment settings: an ``experiment.yaml`` or a sweep file read into a dataclass through jsonargparse,
so an unknown field, a missing one or a value of the wrong type is refused naming the field (and a YAML syntax
error naming its line). Used through :func:`featlearn.experiments.study.load_settings`."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any

from featlearn.errors import ConfigError


def load_settings(path: Path | str, cls: type, data: dict | None = None):
    """``path`` (YAML; or ``data`` already read from it) as a ``cls`` dataclass, through jsonargparse: an
    unknown field, a missing one or a value of the wrong type is a :class:`ConfigError` naming the field.

    A module that defines a ``cls`` with dataclass fields must not postpone its annotations (``from __future__
    import annotations``): jsonargparse would resolve a type named as text in ``sys.modules[cls.__module__]``,
    and a module run by name under another ``__main__`` (``python -m cProfile -m featlearn.experiments.X``) is
    not there, so its nested settings would come back as plain dicts. With real annotations, the nested classes
    are found through :func:`_importable`.

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
    with _importable(cls):
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, "settings")
        try:
            parsed = parser.parse_object({"settings": data})
        except ArgumentError as error:
            raise ConfigError(*_field_error(path, str(error))) from None
        return parser.instantiate(parsed).settings


@contextlib.contextmanager
def _importable(cls: type):
    """jsonargparse finds a dataclass held in a list or a dict by its import path, ``module.Name``. A module run by
    name under another ``__main__`` (``python -m cProfile -m ...``: runpy runs its code in a fresh namespace)
    defines its classes under ``__main__`` without being ``sys.modules["__main__"]``: lend them to that module
    while parsing, under names it does not use."""
    lent = []
    for nested in _dataclasses_in(cls):
        module = sys.modules.get(nested.__module__)
        if module is not None and "." not in nested.__qualname__ and not hasattr(module, nested.__qualname__):
            setattr(module, nested.__qualname__, nested)
            lent.append((module, nested.__qualname__))
    try:
        yield
    finally:
        for module, name in lent:
            delattr(module, name)


def _dataclasses_in(annotation, found: set | None = None) -> set:
    """The dataclasses that ``annotation`` is or holds (fields, list items, dict values), itself included."""
    found = set() if found is None else found
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) and annotation not in found:
        found.add(annotation)
        for f in dataclasses.fields(annotation):
            _dataclasses_in(f.type, found)
    for arg in typing.get_args(annotation):
        _dataclasses_in(arg, found)
    return found


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
