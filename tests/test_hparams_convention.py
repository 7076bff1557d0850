"""One way to hold a method's hyperparameters: an ``__init__`` argument is read as ``self.hparams.<name>``
(Lightning's ``save_hyperparameters``), or kept under its own name when converted (``self.lr = float(lr)``).
Never an alias of ``self.hparams`` (``self.hp``) or the argument under another name (``weight_decay`` as
``self.lam``, ``schedule`` as ``self.schedule_kind``): a reader of ``hparams.yaml`` or a config then finds
every value under the name it has there. Values derived from the data (contrastive's weight decay when
the config leaves it null) are attributes named for what they are, set in ``build``."""
import ast
from pathlib import Path

import pytest

MODULES = sorted((Path(__file__).resolve().parents[1] / "lightning_modules").glob("*.py"))


def _argument(value: ast.expr, names: set[str]) -> str | None:
    """The __init__ argument ``value`` is (``arg``, ``float(arg)``, ``int(arg)``), else None."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("float", "int", "bool") \
            and len(value.args) == 1:
        value = value.args[0]
    return value.id if isinstance(value, ast.Name) and value.id in names else None


def violations(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.FunctionDef) and node.name == "__init__"):
            continue
        names = {a.arg for a in node.args.args + node.args.kwonlyargs} - {"self"}
        for stmt in ast.walk(node):
            if not isinstance(stmt, ast.Assign):
                continue
            for target in stmt.targets:
                pairs = (zip(target.elts, stmt.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(stmt.value, ast.Tuple) else [(target, stmt.value)])
                for t, v in pairs:
                    if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"):
                        continue
                    if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self" \
                            and v.attr == "hparams":
                        found.append(f"line {t.lineno}: self.{t.attr} is an alias of self.hparams")
                    arg = _argument(v, names)
                    if arg is not None and arg != t.attr:
                        found.append(f"line {t.lineno}: argument {arg!r} kept as self.{t.attr}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_hyperparameters_keep_their_names(path):
    assert not violations(path.read_text()), f"{path.name}: {violations(path.read_text())}"


@pytest.mark.parametrize("source, caught", [
    ("class M:\n    def __init__(self, weight_decay):\n        self.lam = float(weight_decay)\n", True),
    ("class M:\n    def __init__(self, a, schedule):\n        self.a, self.kind = a, schedule\n", True),
    ("class M:\n    def __init__(self, lr):\n        self.hp = self.hparams\n", True),
    ("class M:\n    def __init__(self, lr):\n        self.lr = float(lr)\n", False),
    ("class M:\n    def __init__(self, d):\n        self.half = d // 2\n", False),
])
def test_the_check_catches_renamed_arguments(source, caught):
    assert bool(violations(source)) == caught
