"""Reading a model's vocabulary in a forked child before the app reads it itself.

llama.cpp's tokenizer ends the whole process on some malformed vocabularies: a C++ exception
escapes its C API (a byte with no token, a byte token that does not spell a byte), and
`terminate` aborts. Our own checks (engine/modelfile/checks.py) refuse the cases we know; this
catches the rest. A child process loads the vocabulary, turns every token into text and
tokenizes a text holding every byte value; if it dies, the file is refused in one line and
the app goes on. A load that merely fails is left to the caller's own load, which reports it.

A file passes once per version (path, size, modification time), remembered in the user's
cache folder: the child costs ~0.1 s for SmolLM2's vocabulary, ~1.5 s for Gemma 3's 262k.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import time
from pathlib import Path

import platformdirs

from ..errors import ModelFileError
from .library import Llama, llama_cpp

CACHE_DIR_ENV = "MINIAPP_CACHE_DIR"  # the same folder the calibration files use
PROBE_SECONDS = 60.0
_MEMO_ENTRIES = 256
_CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)

# Every byte value UTF-8 text can hold: ASCII, every lead byte of two, three and four-byte
# sequences, every continuation byte; then special-token markup and runs of whitespace.
PROBE_TEXT = "".join(
    [chr(c) for c in range(1, 128)]
    + [chr(lead << 6) for lead in range(2, 32)]  # lead bytes C2..DF
    + [chr(0x80 + i) for i in range(64)]  # C2 followed by every continuation byte
    + [chr(0x800)]
    + [chr(k << 12) for k in range(1, 16)]  # lead bytes E0..EF
    + [chr(0x10000), chr(0x40000), chr(0x80000), chr(0xC0000), chr(0x100000)]  # F0..F4
    + ["<s></s><|im_start|>  \n\n\t end"]
)


def check_vocabulary_apart(path: Path | str) -> None:
    """ModelFileError if reading the vocabulary kills (or hangs) a child process."""
    if not hasattr(os, "fork"):
        return  # Windows: no cheap process to isolate it in
    path = Path(path)
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo = _read_memo()
    if key in memo:
        return
    _run_in_child(path)
    _write_memo([*memo[-(_MEMO_ENTRIES - 1) :], key])


def _run_in_child(path: Path) -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _read_everything(path)
            code = 0
        finally:
            os._exit(code)  # no atexit handlers, no flushing of the parent's buffers
    deadline = time.monotonic() + PROBE_SECONDS
    while True:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise ModelFileError(
                path, f"llama.cpp did not finish reading its vocabulary in {PROBE_SECONDS:.0f} s"
            )
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        raise ModelFileError(path, f"llama.cpp crashed reading its vocabulary ({name})")


def _read_everything(path: Path) -> None:
    """In the child: die of any crash signal (not in a handler the parent set, such as a
    fuzzer's), quietly, and read the vocabulary as the app will."""
    faulthandler.disable()
    for crash in _CRASH_SIGNALS:
        signal.signal(crash, signal.SIG_DFL)
    # ggml's crash handler would attach gdb to print a backtrace (seconds, and on stdout).
    os.environ["GGML_NO_BACKTRACE"] = "1"
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    llama = Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    size = 256
    buffer = (ctypes.c_char * size)()
    for token in range(llama.n_vocab()):  # control tokens aside, both forms take one path
        needed = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, True)
        if needed < 0:
            size = -needed
            buffer = (ctypes.c_char * size)()
            llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, True)
    text = PROBE_TEXT.encode()
    for special in (True, False):
        llama.tokenize(text, add_bos=True, special=special)


def _memo_path() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or platformdirs.user_cache_dir("miniapp")
    return Path(root) / "checked-vocabularies.json"


def _read_memo() -> list[str]:
    try:
        memo = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return []
    return [key for key in memo if isinstance(key, str)] if isinstance(memo, list) else []


def _write_memo(keys: list[str]) -> None:
    """Best effort: a read-only or full cache folder only means checking again next time."""
    path = _memo_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(keys))
        partial.replace(path)
    except OSError:
        pass
