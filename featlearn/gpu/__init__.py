"""GPU readiness: ``featlearn gpu compile`` (every Triton kernel built offline for sm_90, no GPU needed),
``featlearn gpu check`` (the one prepared script for a lent H100/H200, with a CPU dry mode) and
``featlearn gpu wheels`` (the pure-Python wheels the GPU machine lacks, fetched beforehand on a CPU
machine)."""
