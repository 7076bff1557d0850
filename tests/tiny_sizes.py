"""Data and model overrides that shrink each method's run config to a few-second CPU run: shared by the
GPU tests' dry mode, the TensorBoard server test and the newcomer tests (``from tiny_sizes import ...``;
tests/gpu/conftest.py puts this folder on the path for the GPU tests)."""


def over(data=(), model=()) -> list[str]:
    """Command-line overrides: ``--data.init_args.<name> <value>``, ``--model.init_args.<name> <value>``."""
    return [arg for part, values in (("data", dict(data)), ("model", dict(model))) for name, value in values.items()
            for arg in (f"--{part}.init_args.{name}", "null" if value is None else str(value))]


MRP = over(dict(k=4, d=32, P=10, num_pretrain=32, num_downstream=16, num_test=16), dict(m=2))
SPARSE = over(dict(d=8, d1=32, num_negatives=16, batch_size=8, num_val=16, num_test=16), dict(width=8))
PATCHES = over(dict(dim=12, num_patches=8, num_feature_patches=2, batch_size=16, num_val=8, num_test=8))
VIT = dict(P=16, kappa_c=0.75, kappa_s=0.5, batch_size=2, num_val=8, num_test=8)  # the attention op: ~0.1 s a tile
PARITY = dict(dim=24, num_patterns=12, k=3, batch_size=16, num_train=64, num_val=16, num_test=16)
HIDDEN = over(dict(T=2, s=2, r=4, u=2, batch_size=32, num_test=16), dict(probe_repeats=1))
MODADD = over(dict(k=3, p=5, batch_size=16), dict(width=12))
TRANSFORMER = over(dict(k=2, p=7, batch_size=8), dict(heads=2, hidden=16, head_dim=4, mlp_hidden=32, dropout=0.0))
ICL_PARITY = over(dict(d=4, k=2, N=8, p_T=0.1, batch_size=16, num_val=32, num_test=32), dict(heads=4))
XOR = over(dict(d=16, batch_size=64, num_val=64, num_test=64), dict(width=4))
ERM_NU = over(dict(r=4, d=16, gamma=0.4, batch_size=32, num_val=64, num_test=64, num_ood=64))
GEMFILTER = over(dict(context=64, train_context=32, pairs=4, queries=2, fillers=8, keys=16, values=8, batch_size=8,
                      num_val=16, num_test=16),
                 dict(layers=2, heads=2, head_dim=8, hidden=16, mlp_hidden=32, rope_dims=4, val_budgets="[8, 16]"))
BLOCK_PARITY = over(dict(d=16, k=3, batch_size=64, num_val=64, num_test=64), dict(width=4))
ICL = over(dict(d=4, N=8, batch_size=16, num_val=32, num_test=32, eval_examples=6), dict(rank=2))
LOOPED = over(dict(d=3, n=6, batch_size=16, num_val=32, num_test=32), dict(loops=3))
