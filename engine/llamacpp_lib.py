"""The one place that imports llama-cpp-python and routes its native log into Python logging.

llama.cpp prints load and context messages straight to stderr, which would interleave with a
streamed answer; here they go to the `miniapp.llamacpp` logger instead (shown with -v).
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp

log = logging.getLogger("miniapp.llamacpp")

_GGML_LOG_LEVELS = {1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.DEBUG}


@llama_cpp.llama_log_callback
def _route_native_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", "replace").rstrip()
    if message:
        # Even warnings are only interesting when debugging: we report real failures ourselves.
        log.log(min(_GGML_LOG_LEVELS.get(level, logging.DEBUG), logging.DEBUG), message)


llama_cpp.llama_log_set(_route_native_log, ctypes.c_void_p(0))

Llama = llama_cpp.Llama


def llama_supports_gpu_offload() -> bool:
    """Whether this llama.cpp build can put layers on a GPU (CUDA, HIP, Metal, Vulkan...)."""
    return bool(llama_cpp.llama_supports_gpu_offload())


__all__ = ["Llama", "llama_cpp", "llama_supports_gpu_offload"]
