"""Kernels at sizes whose element offsets pass 2^32, run in the Triton interpreter on their last programs only.

``python tests/int32_boundary_cases.py [CASE ...]`` prints, per case, the relative error of the rows those
programs wrote against a float64 reference. ``tests/test_int32_offsets.py`` runs it in a process of its
own: an offset computed in int32 that wraps to a negative number reads unmapped memory and kills the
process, and the last case printed names the culprit.

The big operands are ``torch.empty`` buffers of 8-17 GB that are never touched outside the rows the
last programs read: the pages stay unallocated, so a case needs a few hundred MB of real memory. The
sizes put every offset those programs form between 2^32 and 2^32 + 2^31, so an int32 offset wraps to
a small positive one and reads the wrong rows (zeros) instead of crashing.
"""
import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

import featlearn.kernels as k  # noqa: E402

# the modules (the package re-exports functions under some of their names)
bn, sc, st = (importlib.import_module(f"featlearn.kernels.{name}") for name in
              ("bn_cosine_loss", "smoothed_clamp", "soft_threshold"))

LAST = 4  # programs run: the last group of the grouped order (2 row tiles x 2 column tiles: the last rows whole)
ROW_TILE = 16  # the interpreter's tile (backend.INTERPRETER_GEMM_TILE)


def only_last_programs(n: int):
    """Run only the last ``n`` programs of every launch (in launch order, x fastest), each with the
    program ids and grid size it would have in the full launch."""
    original_run = interpreter.InterpretedFunction.run
    builder = interpreter.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    state = {}

    def run(self, *args, grid, warmup, **kwargs):
        def few(meta):
            real = tuple(grid(meta) if callable(grid) else grid)
            real += (1,) * (3 - len(real))
            total = real[0] * real[1] * real[2]
            state.update(real=real, pids=list(range(max(0, total - n), total)))
            return (len(state["pids"]),)
        return original_run(self, *args, grid=few, warmup=warmup, **kwargs)

    def grid_idx(x, y, z):
        gx, gy, _ = state["real"]
        pid = state["pids"][x]
        set_idx(pid % gx, (pid // gx) % gy, pid // (gx * gy))

    interpreter.InterpretedFunction.run = run
    builder.set_grid_dim = lambda *dims: set_dim(*state["real"])
    builder.set_grid_idx = grid_idx


def rows_past(limit: int, row_length: int) -> int:
    """A row count, a multiple of two row tiles (so the last group of the grouped order is whole), whose
    last two row tiles start past element ``limit``."""
    pair = 2 * ROW_TILE
    return (-(-limit // row_length) // pair + 2) * pair


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm()) if torch.isfinite(out).all() else float("inf")


def fill(t: torch.Tensor, rows: slice) -> torch.Tensor:
    t[rows] = torch.randn_like(t[rows])
    return t[rows].double()


def layer_forward(op: str):
    D, M = 1031, 20
    B = rows_past(2**32, D)
    x = torch.empty(B, D)
    xr = fill(x, slice(B - ROW_TILE, B))
    w, b = torch.randn(M, D), torch.rand(M)
    if op == "soft_threshold":
        out = k.soft_threshold_layer(x, w, b, backend="triton", input_precision="ieee")
        ref = k.soft_threshold_reference(xr, w.double(), b.double())
    else:
        out = k.smoothed_clamp_layer(x, w, b, 0.1, backend="triton", input_precision="ieee")
        ref = k.smoothed_clamp_reference(xr, w.double(), b.double(), 0.1)
    return rel(out[B - ROW_TILE:], ref)


def _code_and_slope(op: str, u: torch.Tensor, b: torch.Tensor):
    """What the forward saves for the backward (soft threshold: the uint8 code; smoothed clamp: the slope)
    and the float64 slope it stands for."""
    if op == "soft_threshold":
        code = (u > b).to(torch.uint8) + 2 * (u < -b).to(torch.uint8)
        return code, ((code & 1) + (code >> 1)).double()
    z = u + b
    slope = ((z > 0) & (z < 1)).double()  # the truncated ReLU's slope (no smoothing)
    return slope.float(), slope


def _backward(op, grad_h, x, w, saved, need):
    if op == "soft_threshold":
        return st._soft_threshold_bwd_triton(grad_h, x, w, saved, need, "ieee")
    return sc._smoothed_clamp_bwd_triton(grad_h, x, w, saved, need, "ieee")


def layer_grad_x(op: str):
    # grad_x [B, D] = (g * slope)[B, M] @ w: g and the saved code or slope are [B, M] with B*M past 2^32
    D, M = 20, 1031
    B = rows_past(2**32, M)
    rows = slice(B - ROW_TILE, B)
    x, w, b = torch.empty(B, D), torch.randn(M, D), torch.rand(M) * 0.1
    fill(x, rows)
    g, saved = torch.empty(B, M), torch.empty(B, M, dtype=torch.uint8 if op == "soft_threshold" else torch.float32)
    saved[rows], slope = _code_and_slope(op, x[rows] @ w.T, b)
    gr = fill(g, rows)
    gx, _, _ = _backward(op, g, x, w, saved, (True, False, False))
    return rel(gx[rows], (gr * slope) @ w.double())


def layer_grad_w(op: str):
    # grad_w [M, D] = (g * slope)^T x reduced over B = 40 rows: g [40, M] and grad_w [M, 32] pass 2^32
    B, D = 40, 32
    M = rows_past(2**32, D)
    cols = slice(M - ROW_TILE, M)
    x, w, b = torch.randn(B, D), torch.empty(M, D), torch.rand(M) * 0.1
    g, saved = torch.empty(B, M), torch.empty(B, M, dtype=torch.uint8 if op == "soft_threshold" else torch.float32)
    wr = fill(w, cols)
    saved[:, cols], slope = _code_and_slope(op, x @ wr.float().T, b[cols])
    gr = fill(g.T, cols).T
    _, gw, _ = _backward(op, g, x, w, saved, (False, True, False))
    return rel(gw[cols], (gr * slope).T @ x.double())


def bn_l2_rows():
    # the per-row l2 loss of rows past 2^32 elements of p and z [N, M]
    M = 131
    N = rows_past(2**32, M)
    p, z = torch.empty(N, M), torch.empty(N, M)
    rows = slice(N - 8, N)  # the interpreter's bn tile has 8 rows
    pr, zr = fill(p, rows), fill(z, rows)
    loss = torch.empty(N)
    bn._bn_cosine_fwd_l2_kernel[(triton.cdiv(N, 8),)](p, z, loss, 1e-6, N, M, ACC=bn.acc_dtype(p))
    ref = torch.stack([bn_cosine_row(pr[i], zr[i]) for i in range(8)])
    return rel(loss[rows], ref)


def bn_cosine_row(f, g, eps=1e-6):
    a, b, c = f @ f, g @ g, f @ g
    return a / (a + eps) + b / (b + eps) - 2 * c / torch.sqrt((a + eps) * (b + eps))


def patch_sum_forward():
    # x [B, P, D] with B*P*D past 2^32 (the op already indexes in int64: kept that way)
    P, D, R = 3, 347, 20
    B = rows_past(2**32, P * D)
    x = torch.empty(B, P, D)
    xr = fill(x, slice(B - ROW_TILE, B))
    w = torch.randn(R, D)
    act = k.Activation("pow", q=3)
    out = k.patch_activation_sum(x, w, act, backend="triton", input_precision="ieee").student
    return rel(out[B - ROW_TILE:], k.patch_activation_sum_reference(xr, w.double(), act).student)


CASES = {
    "soft_threshold-forward": lambda: layer_forward("soft_threshold"),
    "soft_threshold-grad_x": lambda: layer_grad_x("soft_threshold"),
    "soft_threshold-grad_w": lambda: layer_grad_w("soft_threshold"),
    "smoothed_clamp-forward": lambda: layer_forward("smoothed_clamp"),
    "smoothed_clamp-grad_x": lambda: layer_grad_x("smoothed_clamp"),
    "smoothed_clamp-grad_w": lambda: layer_grad_w("smoothed_clamp"),
    "bn_cosine_loss-l2-rows": bn_l2_rows,
    "patch_activation_sum-forward": patch_sum_forward,
}

if __name__ == "__main__":
    only_last_programs(LAST)
    for name in sys.argv[1:] or CASES:
        print(name, end=" ", flush=True)
        torch.manual_seed(0)
        print(f"{CASES[name]():.3e}", flush=True)
