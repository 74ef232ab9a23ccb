"""Our own compute kernels, each beside a pure-torch reference and a test that they agree.

* `int4_gemm.cpp` (loaded by `int4.py`, reference in `reference.py`): small-batch int4
  matmul on the CPU, AVX-512 BF16 and AVX2 paths, with a fused silu(gate) * up variant. The
  engine picks it or torch's op in `miniapp.engine.kernels`.

`build.py` compiles the shared library, at install time (setup.py) or on first use.
"""
