"""Allowed values of config fields, declared once as type annotations and checked the same way from the
command line and from Python.

**The one way to declare a range**: annotate the ``__init__`` argument with a type of this module (or a
``Literal``, ``X | None``, ``list[X]``) and call :func:`check_args` first thing in ``__init__``::

    class MyModule(FeatureLearningModule):
        def __init__(self, m: PositiveInt = 3, lr: PositiveFloat = 1.0, kind: Literal["a", "b"] = "a"):
            check_args("model", MyModule.__init__, locals())
            super().__init__()

* On the command line, jsonargparse reads the annotation and refuses a bad value while parsing, before
  anything is built; :mod:`featlearn.cli` prints its message as ``error: model.m: must be ...``.
* From Python (tests, notebooks), :func:`check_args` calls the same types on the arguments and raises
  :class:`~featlearn.errors.ConfigError` with the same text (``MyModule(m=0)``:
  ``model.m: must be an integer >= 1, got 0``).

The types are jsonargparse types (:func:`jsonargparse.typing.extend_base_type`), so ``--help`` and
``--print_config`` show them. Every float type refuses NaN and infinities (YAML ``.nan``, ``.inf``);
jsonargparse's own ``PositiveFloat``/``NonNegativeFloat`` accept ``inf`` and word their messages as
``v>0``, hence these. Rules that involve several fields (``d >= 2k``) stay hand-written
``ConfigError`` checks after :func:`check_args`. Fields of classes we do not own (the Trainer, the
callbacks) are checked against the same types with :func:`accepts` / :func:`describe` by the CLI
(``featlearn.cli.RUN_FIELDS``).

:func:`check_memory` refuses sizes whose tensors cannot fit in the memory that is free now.

Example:
    >>> def f(m: PositiveInt = 1, p: OpenUnitInterval = 0.5):
    ...     check_args("model", f, locals())
    >>> f(m=0)
    Traceback (most recent call last):
    featlearn.errors.ConfigError: model.m: must be an integer >= 1, got 0
    >>> f(p=float("nan"))
    Traceback (most recent call last):
    featlearn.errors.ConfigError: model.p: must be in (0, 1), got nan
"""
from __future__ import annotations

import functools
import math
import os
import types
import typing
from pathlib import Path
from typing import Literal, Union

from jsonargparse.typing import extend_base_type

from featlearn.errors import ConfigError

__all__ = ["number_type", "PositiveInt", "NonNegativeInt", "int_at_least", "FiniteFloat", "PositiveFloat",
           "NonNegativeFloat", "OpenUnitInterval", "ClosedUnitInterval", "LeftOpenUnitInterval",
           "RightOpenUnitInterval", "check_args", "accepts", "describe", "check_memory", "available_memory",
           "own_cuda_device", "format_bytes", "check_yaml_files"]


def number_type(name: str, base: type, low: float, high: float, low_open: bool, high_open: bool,
                text: str) -> type:
    """A jsonargparse type of ``base`` numbers between ``low`` and ``high`` (ends excluded when ``*_open``),
    described as ``text`` in messages; NaN is never inside. ``name`` must be unique (jsonargparse
    registers it globally)."""
    def validate(cls, value) -> None:
        # bool is an int to Python but never a sensible size or rate; strings come from the command line
        ok = not isinstance(value, bool)
        if ok and isinstance(value, str):
            try:
                value = base(float(value)) if base is int and float(value).is_integer() else base(value)
            except ValueError:
                ok = False
        if ok and not isinstance(value, (int, float)):
            ok = False
        if ok and base is int and isinstance(value, float) and not value.is_integer():
            ok = False
        if ok:
            v = float(value)
            ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        if not ok:  # the command line hands over raw strings: show them as typed
            raise ValueError(f"must be {text}, got {value if isinstance(value, str) else repr(value)}")

    created = extend_base_type(name, base, validate, docstring=f"{base.__name__} that must be {text}",
                               extra_attrs={"_text": text}, register_key=("featlearn", name))

    def new(cls, value):
        # a plain int/float, not an instance of this class: the values reach save_hyperparameters and so
        # checkpoints, which must load with weights_only=True in a process that never imported featlearn
        validate(cls, value)
        return base(float(value)) if base is int and isinstance(value, str) else base(value)

    created.__new__ = new
    return created


_inf = math.inf
PositiveInt = number_type("IntAtLeast1", int, 1, _inf, False, True, "an integer >= 1")
NonNegativeInt = number_type("IntAtLeast0", int, 0, _inf, False, True, "an integer >= 0")


@functools.cache
def int_at_least(n: int) -> type:
    """The type of integers ``>= n`` (e.g. ``int_at_least(3)`` for a power that must be at least 3)."""
    return number_type(f"IntAtLeast{n}", int, n, _inf, False, True, f"an integer >= {n}")


FiniteFloat = number_type("FiniteFloat", float, -_inf, _inf, True, True, "a finite number")
PositiveFloat = number_type("PositiveFiniteFloat", float, 0, _inf, True, True, "a finite number > 0")
NonNegativeFloat = number_type("NonNegativeFiniteFloat", float, 0, _inf, False, True, "a finite number >= 0")
OpenUnitInterval = number_type("OpenUnitIntervalFloat", float, 0, 1, True, True, "in (0, 1)")
ClosedUnitInterval = number_type("ClosedUnitIntervalFloat", float, 0, 1, False, False, "in [0, 1]")
LeftOpenUnitInterval = number_type("LeftOpenUnitIntervalFloat", float, 0, 1, True, False, "in (0, 1]")
RightOpenUnitInterval = number_type("RightOpenUnitIntervalFloat", float, 0, 1, False, True, "in [0, 1)")


# ------------------------------------------------------------------------------------------------
# checking a call's arguments against its annotations
# ------------------------------------------------------------------------------------------------
def describe(annotation) -> str:
    """What an annotation allows, in words (``"an integer >= 1 or null"``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        if len(args) <= 2:
            return " or ".join(repr(a) for a in args)
        return f"one of {args!r}"
    if origin in (Union, types.UnionType):
        words = list(dict.fromkeys(describe(a) for a in args if a is not type(None)))
        return " or ".join(words) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return f"a list whose entries are each {describe(inner[0])}" if inner else "a list"
    if hasattr(annotation, "_text"):
        return annotation._text
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is str:
        return "a string"
    return getattr(annotation, "__name__", str(annotation))


def accepts(annotation, value) -> bool:
    """Whether ``value`` is allowed by ``annotation`` (a type of this module, ``Literal``, union, list)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (Union, types.UnionType):
        return any(accepts(a, value) for a in args)
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return isinstance(value, (list, tuple)) and (not inner or all(accepts(inner[0], v) for v in value))
    if hasattr(annotation, "_text"):
        try:
            annotation(value)
        except (TypeError, ValueError):
            return False
        return not isinstance(value, str)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(annotation, type) and annotation is not typing.Any:
        return isinstance(value, annotation)
    return True


@functools.cache
def _hints(func) -> dict:
    return typing.get_type_hints(func)


def check_args(prefix: str, func, values: dict) -> None:
    """Check every annotated argument of ``func`` in ``values`` (pass ``locals()`` from its first line).

    Raises :class:`~featlearn.errors.ConfigError` naming ``prefix.argument``, what the annotation allows
    and the value given. Arguments without an annotation, or annotated with a type that is not
    described here, are not checked.
    """
    for name, annotation in _hints(func).items():
        if name == "return" or name not in values:
            continue
        value = values[name]
        if not accepts(annotation, value):
            raise ConfigError(f"{prefix}.{name}", describe(annotation), value)


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    """``1.5 GB`` style sizes (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1024 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PB"


def available_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes free now, where that number comes from) on ``device`` (``cpu`` or ``cuda[:i]``).

    A bare ``cuda`` is this process's own GPU (:func:`own_cuda_device`), so that every DDP rank asks
    about its GPU and none opens a CUDA context on another one (``torch.device("cuda")`` would mean the
    current device, GPU 0 on every rank until Lightning selects the rank's)."""
    if str(device).startswith("cuda"):
        import torch

        index = torch.device(device).index
        index = own_cuda_device() if index is None else index
        free, _ = torch.cuda.mem_get_info(index)
        return int(free), f"free memory of cuda:{index} (torch.cuda.mem_get_info)"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM (MemAvailable)"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free RAM"


def own_cuda_device() -> int:
    """The index of this process's GPU, without creating a CUDA context on any GPU: the current device
    once something chose one (Lightning's DDP setup calls ``torch.cuda.set_device``); before that the
    rank's ``LOCAL_RANK`` (set for every rank by torchrun and Lightning's launcher; Lightning gives
    local rank i the i-th device when ``trainer.devices`` is a count); else the current device (0).
    A ``LOCAL_RANK`` beyond the visible GPUs (one GPU per process through ``CUDA_VISIBLE_DEVICES``)
    falls back to the current device as well."""
    import torch

    if torch.cuda.is_initialized() and torch.cuda.current_device() != 0:
        return torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK", "").strip()
    if local.isdigit() and int(local) < torch.cuda.device_count():
        return int(local)
    return torch.cuda.current_device()


def default_device() -> str:
    """Where the samples will be generated by default: the first GPU if there is one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _defaults(func) -> dict:
    """Argument defaults of a function, or of a class's ``__init__`` along its class chain (arguments a
    subclass forwards with ``**kwargs`` keep the default of the class that declares them)."""
    import inspect

    out = {}
    for f in [c.__init__ for c in reversed(func.__mro__)] if isinstance(func, type) else [func]:
        out.update({n: p.default for n, p in inspect.signature(f).parameters.items()
                    if p.default is not inspect.Parameter.empty})
    return out


def _grown_most(func, sizes: dict) -> str:
    """The entry of ``sizes`` that grew most over its default in ``func``'s signature: the likely culprit."""
    defaults = _defaults(func)

    def growth(name):
        default = defaults.get(name)
        base = default if isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0 else 1
        return (sizes[name] or 0) / base

    return max(sizes, key=growth)


def check_memory(prefix: str, func, sizes: dict, needed: float, what: str, device: str | None = None) -> None:
    """Refuse sizes whose tensors need more than the free memory of ``device`` (default: the first GPU
    if there is one, else the CPU), before allocating any of them.

    ``needed`` is the estimate in bytes of everything alive at once (``what`` says what it is made of);
    ``sizes`` maps the fields it depends on to their values. The refusal names ``prefix.field`` for the
    field that grew most over its default in ``func``'s signature (a function, or a class whose
    ``__init__`` chain declares the fields), the estimate and the limit.
    """
    device = default_device() if device is None else device
    limit, source = available_memory(device)
    if needed > limit:
        field = _grown_most(func, sizes)
        raise ConfigError(f"{prefix}.{field}", f"small enough to fit in memory: {what} needs about "
                                              f"{format_bytes(needed)}, the {source} is {format_bytes(limit)}",
                          sizes[field])


# ------------------------------------------------------------------------------------------------
# config files
# ------------------------------------------------------------------------------------------------
def check_yaml_files(args) -> None:
    """Refuse a ``--config`` file (or a YAML file it names, such as ``data: data_tiny.yaml``) that is not
    valid YAML with its path, line and column: jsonargparse reports the parser's words about a
    ``<unicode string>`` and the first line of them only."""
    import yaml

    if not isinstance(args, (list, tuple)):
        return
    paths = [b for a, b in zip(args, args[1:]) if a == "--config"]
    paths += [a.split("=", 1)[1] for a in args if isinstance(a, str) and a.startswith("--config=")]
    seen = set()
    while paths:
        path = Path(paths.pop())
        if path in seen or not path.is_file():  # a missing file is the parser's to refuse
            continue
        seen.add(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or error
            raise ConfigError("--config", "valid YAML", f"{path}{where}: {problem}") from None
        except (OSError, UnicodeDecodeError):
            continue
        paths += [str(path.parent / v) for v in _strings(data) if v.endswith((".yaml", ".yml"))]


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
