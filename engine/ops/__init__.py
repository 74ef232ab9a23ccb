"""The layers' building blocks over the native kernels: quantized linears, norms, RoPE, and the
GGML weight formats."""
