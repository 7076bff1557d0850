"""``featlearn gpu compile|check|wheels`` (also ``python -m featlearn.gpu ...``)."""
import sys

COMMANDS = {
    "compile": ("featlearn.gpu.compile", "every Triton kernel compiled offline for sm_90: registers, spills, shared memory"),
    "check": ("featlearn.gpu.check", "the prepared GPU check (or its CPU dry mode)"),
    "wheels": ("featlearn.gpu.wheels", "download the wheels the GPU machine lacks into .whl/"),
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:8s} {text}" for name, (_, text) in COMMANDS.items())
        sys.exit(f"usage: featlearn gpu {{{','.join(COMMANDS)}}} ...\n{lines}")
    import importlib

    importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
