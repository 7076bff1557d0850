"""``featlearn bench``: one harness for the op and training-step benchmarks (see :mod:`featlearn.bench.harness`)."""
