"""``featlearn gpu compile``: the launches it builds are every kernel's, and a float64 build for sm_90 works.

The whole check (every kernel x variant x config, about 5 minutes) runs in CI as its own step
(``make compile-check``, and under triton 3.6 ``make triton36-check``); here: its coverage, its rules, and
a few real sm_90 builds (float64 dots, which triton 3.6 refuses unless ``out_dtype`` is the float64
accumulator), and GemFilter's token selection in bfloat16 (the one op that reads half-precision inputs) and float64.
"""
import importlib
import pkgutil

import pytest
from triton.runtime.autotuner import Autotuner

import featlearn.kernels
from featlearn.gpu import compile as gc


@pytest.fixture(scope="module")
def launches():
    return gc.capture()


def _kernels_in_package():
    out = set()
    for info in pkgutil.iter_modules(featlearn.kernels.__path__):
        mod = importlib.import_module(f"featlearn.kernels.{info.name}")
        out |= {name for name, obj in vars(mod).items() if isinstance(obj, Autotuner) and name.endswith("_kernel")}
    return out


def test_every_kernel_is_launched_by_some_case(launches):
    assert {launch["kernel"] for launch in launches} == _kernels_in_package()


def test_every_dot_kernel_is_built_in_each_precision(launches):
    """fp32 IEEE, fp32 TF32 and fp64: the variants every op with a ``tl.dot`` accepts."""
    seen = {}
    for launch in launches:
        c = launch["constants"]
        if "PRECISION" in c:
            seen.setdefault(launch["kernel"], set()).add((c["ACC"]["dtype"], c["PRECISION"]))
    assert seen and all(v == {("fp32", "ieee"), ("fp32", "tf32"), ("fp64", "ieee")} for v in seen.values()), seen


def test_launch_signature_follows_the_arguments(launches):
    fwd = next(x for x in launches if x["kernel"] == "_soft_threshold_fwd_kernel" and x["case"] == "contrastive-medium/fp64")
    # float64 saves an int32 code: triton 3.6 cannot feed a float64 dot from 8-bit data
    assert fwd["signature"]["x_ptr"] == "*fp64" and fwd["signature"]["code_ptr"] == "*i32"
    fp32 = next(x for x in launches if x["kernel"] == "_soft_threshold_fwd_kernel" and x["case"] == "contrastive-medium/fp32-ieee")
    assert fp32["signature"]["code_ptr"] == "*u8"
    assert fwd["signature"]["D"] == "i32" and fwd["constants"]["ACC"] == {"dtype": "fp64"}
    unaligned = next(x for x in launches if x["kernel"] == "_soft_threshold_fwd_kernel" and "unaligned" in x["case"])
    names = list(unaligned["signature"])
    assert names.index("D") not in unaligned["attrs"]  # D = 500: not divisible by 16, compiled as such
    assert names.index("M") not in unaligned["attrs"] and names.index("x_ptr") in unaligned["attrs"]


def test_problems_flag_spills_only_where_the_autotuner_may_pick():
    row = {"error": "", "shared": 1024, "stack": 64, "config": {"may_pick": True}}
    assert gc.problems(row) == ["spills (64 B stack)"]
    assert gc.problems({**row, "config": {"may_pick": False}}) == []
    assert gc.problems({**row, "stack": 0, "shared": gc.SM90_SHARED_LIMIT + 1})[0].startswith("shared")
    assert gc.problems({**row, "error": "CompilationError: ..."})[0] == "compile error"


def test_float64_dots_build_for_sm90(launches):
    """One float64 build per dot pattern (GEMM epilogue, attention's three dots), in worker processes that
    run triton in compiled mode: no error, shared memory within the H100's 227 KB, no spills."""
    wanted = {("_soft_threshold_fwd_kernel", "contrastive-medium/fp64"), ("_masked_attn_fwd_kernel", "vit-cl/fp64"),
              ("_masked_attn_bwd_dq_kernel", "vit-cl/fp64")}
    picked = [x for x in launches if (x["kernel"], x["case"]) in wanted]
    jobs = gc.jobs_from(picked, all_configs=False)
    last = {}
    for job in jobs:  # the last config that fits: the smallest tiles, the quickest builds
        last[job["kernel"]] = job
    rows = gc.compile_all(list(last.values()), workers=2)
    assert len(rows) == 3
    for row in rows:
        assert not gc.problems(row), (row["kernel"], row["config"], row["error"])
        assert row["regs"] > 0


def test_token_selection_builds_for_sm90_in_bf16_and_fp64(launches):
    """LLaMA 3.1 8B's selection (H_kv = 8, Dh = 128, 128k tokens) with bf16 keys, as the models hold them, and in
    float64: each kernel's last fitting config builds with no error and no spill (the bf16 and float32 launches
    share one pooling build: the partial scores are float32 either way)."""
    wanted = {"llama31-8b-128k/bf16", "llama31-8b-128k/fp64"}
    picked = [x for x in launches if x["op"] == "token_selection" and x["case"] in wanted]
    assert {x["signature"]["k_ptr"] for x in picked if "k_ptr" in x["signature"]} == {"*bf16", "*fp64"}
    last = {}
    for job in gc.jobs_from(picked, all_configs=False):
        last[(job["kernel"], str(job["signature"]))] = job
    rows = gc.compile_all(list(last.values()), workers=2)
    assert len(rows) == 4
    for row in rows:
        assert not gc.problems(row), (row["kernel"], row["config"], row["error"])
