import os

# Triton kernels are tested on CPU through the interpreter; must be set before triton is imported.
os.environ["TRITON_INTERPRET"] = "1"
