"""Tests of the Triton kernels, run by Triton's CPU interpreter. The main suite runs this
folder in a process of its own (tests/test_triton_kernels.py), with the Triton that
`make setup` installs beside the virtual environment on its path: the main process keeps
the CPU install's torch without Triton, as users have it. Collected only there."""

from __future__ import annotations

import importlib.util
import os

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
collect_ignore_glob = [] if INTERPRETED else ["test_*.py"]
