"""``featlearn gpu check --dry`` (the prepared GPU check rehearsed on the CPU), the GPU sizes of ``featlearn
bench``, the ceilings file and the offline side of ``featlearn gpu wheels``. Nothing here needs a GPU, a
registry or the network; the GPU run itself is docs/gpu.md's two device commands."""
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from featlearn.bench import ops, steps
from featlearn.gpu import ceilings, check, wheels

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~2 minutes; CI runs it as its own step (`make gpu-check-dry`)
def test_dry_mode_runs_every_piece_into_few_files(tmp_path):
    """Both parts end to end on the CPU: every piece ok or skipped with its reason, the summary table
    printed and in summary.md, the results files in OUT (at most 8 files, none deeper than OUT)."""
    out = tmp_path / "out"
    env = {**os.environ, "FEATLEARN_GPU_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "featlearn.gpu", "check", str(out), "--dry"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    summary = (out / "summary.md").read_text()
    rows = dict(re.findall(r"^\| ([^|]+?) \| (ok|skipped|failed|timeout) \|", summary, re.M))
    assert list(rows) == [p.name for p in check.PIECES], summary
    assert set(rows.values()) <= {"ok", "skipped"}, summary + "\n" + proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0
    assert "| piece | status | seconds | headline |" in proc.stdout.split("featlearn gpu check, part all")[-1]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.parent == out for p in files), files
    expected = {"env.txt", "ceilings.csv", "log.txt", "summary.md"}
    expected |= {f for piece, f in (("bench op", "bench_op.csv"), ("bench step", "bench_step.csv"),
                                    ("large-k MRP", "large_k.csv")) if rows[piece] == "ok"}
    assert expected <= {p.name for p in files}
    assert set(ceilings.read(out / "ceilings.csv")) == {"copy", "sgemm", "dgemm"}  # no TF32 on a CPU
    for piece in check.PIECES:  # every piece that ran left its output in the log
        assert rows[piece.name] == "skipped" or f"===== {piece.name} (part {piece.part})" in (out / "log.txt").read_text()


def test_gpu_sizes_have_tf32_variants_rates_and_few_compiles():
    """The cases of --size gpu as CUDA builds them (built, not run): IEEE and TF32 beside each other, SDPA
    for attention, model FLOPs or bytes on every case, torch.compile only where the budget allows."""
    cuda = torch.device("cuda")
    cases = ops.cases(list(ops.OPS), "gpu", cuda)
    assert {c.name for c in cases} == set(ops.OPS)
    for case in cases:
        names = [v.name for v in case.variants]
        assert case.flops or case.bytes, case.name
        budget = case.name in ops.COMPILED_AT_GPU or (case.name == "masked_attention" and "fwd+bwd" in case.shape)
        assert ("compiled" in names) == budget, (case.name, case.shape, names)
        if case.flops:  # ops with dots: IEEE and TF32 side by side, TF32 held to its own tolerance
            assert {"eager", "eager tf32"} <= set(names)
            assert all(v.tolerance for v in case.variants if v.precision == "tf32")
        if case.name == "masked_attention":
            assert {"sdpa", "sdpa math", "featlearn triton", "featlearn triton tf32"} <= set(names)
    compiled = sum("compiled" in [v.name for v in c.variants] for c in cases)
    assert compiled == len(ops.COMPILED_AT_GPU)
    step_cases = steps.cases(list(steps.GPU_METHODS), "gpu", cuda)
    assert [c.name for c in step_cases] == list(steps.GPU_METHODS) and all(c.flops for c in step_cases)
    for name in steps.GPU_METHODS:  # the medium configs are ones the modules accept (attach checks, no data drawn)
        spec, _ = steps.gpu_method(name)
        spec.model(**spec.model_args).attach(spec.data(**{**spec.data_args, "seed": 0}))


def test_cuda_variants_pass_their_checks_through_the_interpreter():
    """Every variant CUDA would time (TF32, Triton, SDPA), built for CUDA and run on CPU tensors at the smoke
    size through the Triton interpreter, passes its float64 check: a GPU run only has to time them."""
    from featlearn.bench import harness

    for case in ops.cases(list(ops.OPS), "smoke", torch.device("cuda")):
        case.variants = [v for v in case.variants if v.name != "compiled"]  # compile time, no new code path
        results = harness.check(case, torch.device("cpu"), seed=0)
        assert all(r.passed for r in results), [(r.variant, r.note) for r in results if not r.passed]
        assert {r.precision for r in results} == ({"ieee", "tf32"} if case.flops else {"ieee"}), case.name


@pytest.mark.parametrize("what", ["op", "step"])
def test_size_gpu_is_refused_off_cuda(what, capsys, tmp_path):
    from featlearn.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", what, "--size", "gpu", "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: --size") and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_ceilings_measure_write_read_and_rates(tmp_path):
    rows = ceilings.measure(torch.device("cpu"), n=64, copy_bytes=1 << 20, warmup=1, repeats=2)
    assert [r["name"] for r in rows] == ["copy", "sgemm", "tf32", "dgemm"]
    values = ceilings.read(ceilings.write(rows, tmp_path / "c.csv"))
    assert set(values) == {"copy", "sgemm", "dgemm"} and all(v > 0 for v in values.values())
    assert ceilings.device_of(tmp_path / "c.csv") == "cpu"
    tf, frac, gbs, frac_copy = ceilings.achieved(1e12, 2e9, 0.5, "fp64", {"dgemm": 4.0, "copy": 8.0})
    assert (tf, frac, gbs, frac_copy) == (2.0, 0.5, 4.0, 0.5)
    assert all(x != x for x in ceilings.achieved(None, None, 0.5, "tf32", {}))  # no counts: NaN, not an error


def test_wheels_follow_requires_dist_for_python_312():
    """jsonargparse[signatures] on CPython 3.12: docstring-parser and typeshed-client, not the other extras,
    not what the GPU image has (typing-extensions, PyYAML)."""
    requires = ['PyYAML>=3.13', 'jsonargparse[typing-extensions]; extra == "signatures"',
                'docstring-parser>=0.17; extra == "signatures"', 'typeshed-client>=2.8.2; extra == "signatures"',
                'toml>=0.10.2; extra == "toml"', 'typing-extensions>=4.12.0; python_version < "3.11" and extra == '
                '"typing-extensions"', 'importlib-resources; python_version < "3.9"']
    assert [r.name for r in wheels.needs(requires, {"signatures"})] == ["jsonargparse", "docstring-parser",
                                                                        "typeshed-client"]
    assert wheels.needs(requires, {"typing-extensions"}) == []  # 3.12: the marker is false; and it is on the image
    assert [r.name for r in wheels.needs(requires, set())] == []


def test_staged_package_imports_from_the_tree(tmp_path):
    """The GPU machine's install of featlearn (symlinks laid out as pyproject's package-dir) imports with the
    repository root off sys.path, and finds configs/ where the experiments look for it."""
    site = tmp_path / "site"
    site.mkdir()
    wheels.stage(site)
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    probe = ("import featlearn, featlearn.kernels.backend, featlearn.gpu.check as c; "
             "from importlib.metadata import version; print(featlearn.__file__, c.ROOT, version('featlearn'))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    file, root, version = out.stdout.split()
    assert file.startswith(str(site)) and Path(root) == ROOT
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
