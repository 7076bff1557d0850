"""How the ``featlearn`` / ``lightning`` command reports a bad command line or config: one line,
``error: <field>: <what is allowed>, got <value>``, never a usage text or a traceback (:mod:`featlearn.cli`)."""
import argparse
import ast
import difflib
import math
import re
import sys
from typing import Literal

from lightning.pytorch.cli import LightningArgumentParser

from featlearn.errors import ConfigError
from featlearn.validation import NonNegativeInt, PositiveInt, describe, int_at_least, number_type

GrowthFactor = number_type("GrowthFactor", float, 1, math.inf, True, True, "a finite factor > 1")

# Trainer and callback fields whose types (from Lightning) admit values that fail only once training runs
# (a ZeroDivisionError at the first logged step) or deep inside the Trainer; checked after parsing.
RUN_FIELDS = {
    "trainer.max_steps": (int_at_least(-1), "-1: no limit"),
    "trainer.min_steps": (NonNegativeInt | None, ""),
    "trainer.max_epochs": (int_at_least(-1) | None, "-1: no limit"),
    "trainer.min_epochs": (NonNegativeInt | None, ""),
    "trainer.log_every_n_steps": (PositiveInt | None, ""),
    "trainer.check_val_every_n_epoch": (PositiveInt | None, ""),
    "trainer.num_nodes": (PositiveInt, ""),
    "trainer.num_sanity_val_steps": (int_at_least(-1) | None, ""),
    "trainer.accumulate_grad_batches": (Literal[1], "sample streams follow the optimizer step; raise "
                                                    "data.batch_size instead"),
    "checkpoint.every_n_train_steps": (NonNegativeInt | None, "0 or null: no periodic saves"),
    "checkpoint.every_n_epochs": (NonNegativeInt | None, ""),
    "checkpoint.save_top_k": (int_at_least(-1), ""),
    "heatmap.every_n_steps": (PositiveInt, ""),
    "divergence.window": (PositiveInt, ""),
    "divergence.loss_growth": (GrowthFactor | None, ""),
    "divergence.weight_growth": (GrowthFactor | None, ""),
    "divergence.check_every_n_steps": (PositiveInt | None, "null: trainer.log_every_n_steps"),
}
class _ShortErrorParser(LightningArgumentParser):
    """Print a parse error as one line, ``error: <field>: <what is wrong>``, without the usage text."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # an inner parser: its caller reports the error
            return super().error(message, ex)
        _refuse(short_message(message) + self._suggestion(message))

    def _suggestion(self, message: str) -> str:
        """``; did you mean --trainer.max_steps?`` for an option or config key the parser does not know."""
        unknown = (re.search(r"unrecognized arguments: -*([\w.]+)", message, re.IGNORECASE)
                   or re.search(r"does not accept option '([\w.]+)'", message))
        if unknown is None:
            return ""
        known = [o[2:] for p in self._parsers() for o in p._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(unknown.group(1), known, n=1, cutoff=0.75)
        return f"; did you mean --{close[0]}?" if close else ""

    def _parsers(self):
        """This parser and its subcommands' (``fit``, ``validate``, ...)."""
        found = [self]
        for action in self._actions:
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):
                found += [p for p in choices.values() if isinstance(p, argparse.ArgumentParser)]
        return found


def _refuse(line: str):
    sys.stderr.write(f"error: {line}\n")
    raise SystemExit(2)


def short_message(message: str) -> str:
    """``field: reason`` from a jsonargparse error, which nests one ``Parser key "name":`` block per class
    level (``model`` > ``m``) around the reason (``Not of type IntAtLeast1: must be ..., got 0``)."""
    keys, reason = [], None
    for raw in message.splitlines():
        line = raw.strip().lstrip("-").strip()
        key = re.match(r'Parser key "([^"]+)":\s*(.*)$', line)
        if key:
            keys.append(key.group(1))
            line = key.group(2)
        if not line or line.startswith(("Does not validate against", "Subtypes:", "Errors:", "Problem with given",
                                        "Given value", "Expected a <class 'NoneType'>")):
            continue
        reason = line
        break
    if not keys:
        return message.strip().splitlines()[0] if message.strip() else "invalid arguments"
    field = ".".join(k for k in keys if k != "init_args").replace(".init_args.", ".")
    reason = reason or "invalid value"
    reason = re.sub(r"^Not of type \w+: ", "", reason)
    literal = re.match(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$", reason)
    if literal:
        try:
            allowed = describe(Literal[ast.literal_eval(f"({literal.group(1)},)")])
        except (ValueError, SyntaxError):
            allowed = f"one of ({literal.group(1)})"
        reason = f"must be {allowed}, got {literal.group(2)!r}"
    plain = re.match(r"Expected a <class '(\w+)'>(?:\. Got value: (.*))?$", reason)
    given = re.search(r"^\s*Given value: (.*)$", message, re.MULTILINE)
    given = plain.group(2) if plain and plain.group(2) is not None else given.group(1) if given else None
    if plain and field in RUN_FIELDS:  # a Lightning annotation (float | None): say what featlearn allows
        allowed, note = RUN_FIELDS[field]
        reason = f"must be {describe(allowed)}" + (f" ({note})" if note else "") + f", got {given!r}"
    elif plain and plain.group(1) == "float" and given is not None and _not_finite(given):
        reason = f"must be a finite number, got {given!r}"   # nan and inf are floats to Python, not to us
    elif plain:
        reason = f"must be of type {plain.group(1)}, got {given!r}"
    return f"{field}: {reason}"


def _not_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _check_devices(value) -> None:
    """``trainer.devices``: a count >= 1, -1 (every device), 'auto', or device ids (a list, or '0,1')."""
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    ids = value if isinstance(value, (list, tuple)) else None
    if isinstance(value, str) and "," in value:
        ids = [int(p) if p.strip().isdigit() else -1 for p in value.split(",") if p.strip()]
    ok = (value == "auto" or value == -1 or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
          or (ids is not None and len(ids) > 0 and all(isinstance(i, int) and i >= 0 for i in ids)))
    if not ok:
        raise ConfigError("trainer.devices", "a device count >= 1, -1 (all), 'auto' or a list of device ids",
                          value)


def _config_error(err: Exception) -> ConfigError | None:
    """The ConfigError behind an error raised while instantiating (jsonargparse re-raises what a class
    raises as its own ValueError, sometimes keeping only the text)."""
    seen = err
    while seen is not None:
        if isinstance(seen, ConfigError):
            return seen
        seen = seen.__cause__ or seen.__context__
    for line in str(err).splitlines():
        field, sep, rest = line.strip(" -").partition(": must be ")
        if sep and re.fullmatch(r"[\w.]+", field):
            allowed, _, got = rest.rpartition(", got ")
            return ConfigError(field, allowed or rest, got)
    return None


def _raised_by_trainer(err: BaseException) -> bool:
    """Whether Lightning's Trainer set-up (accelerator, strategy, precision connectors) raised ``err``."""
    tb = err.__traceback__
    while tb is not None:
        if "lightning/pytorch/trainer/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False
