"""A test hook that makes the engine fail, for what must survive a failing engine (the
server's circuit breaker, its error paths): with MINIAPP_FAULT_FILE set when the process
starts, every batched step raises `InjectedFault` while that file exists. A test creates the
file to break the engine and deletes it to mend it, from outside the process.

Unset (always, outside tests), the check is one comparison with None a step.
"""

from __future__ import annotations

import os

FAULT_FILE_VARIABLE = "MINIAPP_FAULT_FILE"
_FAULT_FILE = os.environ.get(FAULT_FILE_VARIABLE) or None


class InjectedFault(RuntimeError):
    """The failure a test asked for (not a MiniappError: it stands for the engine's own)."""


def check_injected_fault() -> None:
    if _FAULT_FILE is not None and os.path.exists(_FAULT_FILE):
        raise InjectedFault(f"a fault was injected ({_FAULT_FILE} exists)")
