"""Our own compute kernels, each beside a pure-torch reference and a test that they agree.

* `int4_gemm.cpp` (loaded by `int4.py`, reference in `reference.py`): small-batch int4
  matmul on the CPU, AVX-512 BF16 and AVX2 paths, with a fused silu(gate) * up variant. The
  engine picks it or torch's op in `miniapp.engine.platform.kernels`.
* `ggml_dot.cpp` (loaded by `ggml.py`, reference `reference.ggml_matmul`): the same small-batch
  matmul straight on GGML's quantized blocks as the file stores them (Q4_0 to Q8_0, Q4_K,
  Q5_K, Q6_K), AVX-512 VNNI and AVX2 paths; compiled into the same library.
* `attention.cpp` and `kv_codec.cpp` (both through `attention.py`): decode attention over the
  KV cache as stored, and the codecs of its storage types (their layouts in `kv_codec.h`).
* `row_ops.cpp` (`row_ops.py`): RMS norm (after a residual add) and RoPE, in place.
* `decode_layer.cpp` (`decode_layer.py`): a decoder layer's whole step in one call, made of
  the kernels above.
* `common.h`: what the C++ files share (ISA macros, the CPU check, what one calls in another).

`build.py` compiles the shared library, at install time (setup.py) or on first use.
"""
