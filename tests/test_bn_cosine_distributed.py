"""Data-parallel batch statistics of the fused loss: 2 CPU processes (gloo) with unequal local batches give
the loss and the gradient of one process on the concatenated batch (the paper's batch-norm statistics are
the global batch's)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from featlearn.kernels.bn_cosine_loss import bn_column_stats, bn_cosine_loss

ROWS = (13, 22)  # unequal local batches, not multiples of the interpreter tile
M = 3
CASES = [("bn", 0.0, "torch"), ("bn", 0.1, "triton"), ("l2", 0.0, "triton"), ("l2", 0.2, "torch")]


def _data():
    g = torch.Generator().manual_seed(7)
    p = torch.randn(sum(ROWS), M, generator=g, dtype=torch.float64) * 3 + 1
    z = 0.5 * p + torch.randn(sum(ROWS), M, generator=g, dtype=torch.float64)
    return p, z


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, outdir: str):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        p, z = _data()
        lo = sum(ROWS[:rank])
        pl, zl = p[lo:lo + ROWS[rank]].clone().requires_grad_(), z[lo:lo + ROWS[rank]]
        res = {}
        for out_norm, eps, backend in CASES:
            loss = bn_cosine_loss(pl, zl, out_norm=out_norm, eps=eps, backend=backend)  # sync=None: auto
            (g,) = torch.autograd.grad(loss, (pl,))
            res[(out_norm, eps, backend)] = (loss.detach(), g)
        compiled = torch.compile(bn_cosine_loss, backend="eager")  # a compiled loss on several ranks
        for out_norm, eps, _ in CASES:
            loss = compiled(pl, zl, out_norm=out_norm, eps=eps)
            res[("compiled", out_norm, eps)] = (loss.detach(), *torch.autograd.grad(loss, (pl,)))
        res["rho"] = bn_column_stats(pl.detach(), zl, backend="torch")["rho"]
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_equals_concatenated_batch(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    p, z = _data()
    for case in CASES:
        out_norm, eps, _ = case
        pr = p.clone().requires_grad_()
        loss = bn_cosine_loss(pr, z, out_norm=out_norm, eps=eps, backend="torch", sync=False)
        (g,) = torch.autograd.grad(loss, (pr,))
        loss = loss.detach()
        for key in (case, ("compiled", out_norm, eps)):  # under torch.compile too: the synced Function, untraced
            for r in range(2):  # every rank holds the global loss
                assert float(ranks[r][key][0]) == pytest.approx(float(loss), rel=1e-12, abs=1e-14), key
            g_dist = torch.cat([ranks[0][key][1], ranks[1][key][1]])
            assert torch.allclose(g_dist, g, rtol=1e-10, atol=1e-14 * float(g.abs().max())), key
        # and it differs from the per-rank (unsynced) loss: the test would catch missing statistics sync
        local = bn_cosine_loss(p[:ROWS[0]], z[:ROWS[0]], out_norm=out_norm, eps=eps, backend="torch", sync=False)
        assert abs(float(local) - float(loss)) > 1e-6
    rho = bn_column_stats(p, z, backend="torch", sync=False)["rho"]
    assert torch.allclose(ranks[0]["rho"], rho, atol=1e-13) and torch.allclose(ranks[1]["rho"], rho, atol=1e-13)
