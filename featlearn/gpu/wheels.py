"""The pure-Python wheels the lent GPU machine lacks: fetched beforehand here, installed there with no registry.

The GPU machine (docs/gpu.md) has Python 3.12, torch, triton, lightning, torchmetrics, tensorboard,
matplotlib, numpy and pytest, but no jsonargparse (which the ``lightning`` / ``featlearn`` command needs),
no package registry and no internet. So, on a machine with the registry:

    featlearn gpu wheels            # (make gpu-wheels) -> .whl/*.whl, git-ignored, travels with the tree

downloads, for CPython 3.12 on manylinux x86_64 (``--only-binary=:all: --no-deps``), jsonargparse at the
version of this ``.venv`` and, following each wheel's ``Requires-Dist`` (markers evaluated for Python 3.12
and the extras asked for), everything it needs for ``jsonargparse[signatures]`` that the GPU image does not
have (:data:`ON_GPU_IMAGE`): docstring-parser and typeshed-client, each at this ``.venv``'s version. One
version of each wheel is kept; anything else in the folder is removed.

On the GPU machine, with nothing of featlearn importable yet (so this file runs as a script, stdlib only):

    python3 featlearn/gpu/wheels.py --install /tmp/featlearn-gpu/site   # (make gpu-check-install)

installs the wheels into that folder (``pip install --no-index --no-deps --target``; without pip, a pure
wheel is unzipped, which is what installing it amounts to) and stages featlearn there as symlinks that
follow pyproject.toml's package-dir (``featlearn.kernels`` = ``kernels/``, ...). Symlinks, not ``pip
install .``: a copied package would look for ``configs/`` beside its copy (``experiments/common.py``
resolves it from ``__file__``), and building a wheel needs setuptools (and, below 70.1, ``wheel``) on the
image. Then ``PYTHONPATH=SITE PYTHONSAFEPATH=1 python3 -m featlearn...`` runs featlearn from the tree
(PYTHONSAFEPATH: the repository root must not shadow the staged package with its bare ``featlearn/``).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".whl"
TOP = "jsonargparse[signatures]"
ON_GPU_IMAGE = {"typing-extensions", "pyyaml", "numpy", "packaging", "setuptools", "torch", "triton", "lightning",
                "pytest"}
"""Distributions the GPU image has (lightning needs PyYAML and typing-extensions): never downloaded."""
TARGET = dict(python_version="3.12", python_full_version="3.12.0", implementation_name="cpython",
              platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
              platform_machine="x86_64", os_name="posix", implementation_version="3.12.0")
"""The marker environment of the GPU machine."""
PIP_TARGET = ["--only-binary=:all:", "--no-deps", "--python-version", "3.12", "--implementation", "cp", "--abi",
              "cp312", "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def metadata_requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def needs(requires: list[str], extras: set[str]) -> list:
    """The requirements that apply on the GPU machine with ``extras`` asked for, minus what its image has."""
    from packaging.requirements import Requirement

    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({**TARGET, "extra": e}) for e in extras | {""}):
            continue
        if canonical(req.name) not in ON_GPU_IMAGE:
            out.append(req)
    return out


def _pin(req) -> str:
    """``name==version`` of this environment when it satisfies ``req`` (the versions tested here), else ``req``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version(req.name)
    except PackageNotFoundError:
        return f"{req.name}{req.specifier}"
    if (not req.specifier or req.specifier.contains(have, prereleases=True)):
        return f"{req.name}=={have}"
    return f"{req.name}{req.specifier}"


def download(dest: Path = WHEELS) -> list[Path]:
    """Fetch :data:`TOP` and what it needs on the GPU machine into ``dest``; returns the wheels kept."""
    from packaging.requirements import Requirement

    queue, seen, kept = [Requirement(TOP)], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        while queue:
            req = queue.pop(0)
            name = canonical(req.name)
            if name in seen:
                seen[name] |= set(req.extras)  # an extra asked for later: its needs are read below too
            else:
                seen[name] = set(req.extras)
                spec = _pin(req)
                folder = Path(tmp) / name
                got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", *PIP_TARGET, "-d", str(folder),
                                      spec])
                if got.returncode:
                    sys.exit(f"pip download {spec} failed (exit {got.returncode}): is the package registry reachable?")
                (wheel,) = folder.glob("*.whl")
                kept.append(wheel)
            wheel = next(w for w in kept if canonical(w.name.split("-")[0]) == name)
            queue += [r for r in needs(metadata_requires(wheel), seen[name]) if canonical(r.name) not in seen]
        dest.mkdir(parents=True, exist_ok=True)
        names = {w.name for w in kept}
        for old in dest.glob("*.whl"):  # one version of each: the folder holds exactly this set
            if old.name not in names:
                old.unlink()
                print(f"removed {old.name}")
        for wheel in kept:
            shutil.copy2(wheel, dest / wheel.name)
    return [dest / w.name for w in kept]


def install(site: Path, wheels: Path = WHEELS) -> None:
    """The wheels in ``wheels`` and featlearn (staged as symlinks) into ``site``, with no registry; then an
    import check as the pieces of ``featlearn gpu check`` will run."""
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    found = sorted(wheels.glob("*.whl"))
    if found:
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                              str(site), *map(str, found)])
        if pip.returncode:
            print("pip install failed or no pip: unzipping the pure-Python wheels instead")
            for wheel in found:
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(site)
    else:
        print(f"no wheels in {wheels} (run `make gpu-wheels` where the registry is): jsonargparse must be installed")
    stage(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "PYTHONSAFEPATH": "1"}
    # light on purpose (no torch import: the device command's 5 minutes are the check's); configs/ is where
    # experiments/common.py looks for it, beside the resolved experiments/ folder
    probe = ("import pathlib, featlearn, featlearn.experiments, jsonargparse; "
             "c = pathlib.Path(featlearn.experiments.__file__).resolve().parents[1] / 'configs'; "
             "assert c.is_dir(), c; print('featlearn from', featlearn.__file__, '| jsonargparse', jsonargparse.__version__)")
    check = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env)
    if check.returncode:
        sys.exit(f"featlearn is not importable from {site} (see above)")
    print(f"installed into {site}: {', '.join(w.name for w in found) or 'no wheels'}; featlearn staged from {ROOT}")


def stage(site: Path) -> None:
    """``site/featlearn``: a folder of symlinks to the tree, laid out as pyproject.toml's package-dir says,
    and a dist-info so that ``importlib.metadata`` knows featlearn."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package = site / "featlearn"
    package.mkdir()
    for entry in (ROOT / "featlearn").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in project["tool"]["setuptools"].get("package-dir", {}).items():
        if name.startswith("featlearn."):  # featlearn.kernels = kernels/ -> site/featlearn/kernels
            (package / name.split(".", 1)[1]).symlink_to(ROOT / folder)
    version = project["project"]["version"]
    info = site / f"featlearn-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: featlearn\nVersion: {version}\n")
    (info / "INSTALLER").write_text("featlearn gpu wheels --install (symlinks to the tree)\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="featlearn gpu wheels", description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=WHEELS, help="folder of the wheels (default .whl/, git-ignored)")
    parser.add_argument("--install", type=Path, metavar="SITE",
                        help="(on the GPU machine) install the wheels and stage featlearn into SITE instead")
    args = parser.parse_args(argv)
    if args.install is not None:
        install(args.install, args.dest)
        return
    wheels = download(args.dest)
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 1024:8.0f} KiB  {wheel.name}")
    print(f"{total / 1024:8.0f} KiB  total, {len(wheels)} wheels in {args.dest}")


if __name__ == "__main__":
    main()
