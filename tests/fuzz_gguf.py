"""Coverage-guided fuzzing of everything a GGUF file reaches before the first token.

`load_to_first_token` is that path: our reader, the file checks, metadata to config, every
tensor's shape, type and scales, repacking into the int4 kernel's format, the chat template
(compiled and rendered), and llama.cpp's vocab-only load that gives us the tokenizer. A bad
file may only end in a `MiniappError`; any other exception, a native crash, a hang past the
timeout or memory past the limit is a finding, which libFuzzer saves under
build/fuzz/crashes/. Each one found becomes a regression file in tests/data/gguf_crashers/,
which tests/test_gguf_crashers.py runs in `make test`.

    make fuzz                      # 10 minutes; FUZZ_MINUTES=30 make fuzz for longer
    python tests/fuzz_gguf.py --minutes 5 --corpus build/fuzz/corpus

The seed corpus is the tiny models the tests write (tests/tiny_gguf.py), one per
architecture and per weight type, plus one carrying a chat template.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["miniapp.engine", "gguf", "jinja2"]):
    import torch
    from first_token import SEED_TEMPLATE, load_to_first_token
    from gguf.constants import GGMLQuantizationType as Q

    from miniapp.engine.errors import MiniappError


def write_seeds(folder: Path) -> list[Path]:
    """The tiny models of tests/tiny_gguf.py, each as small as it can be."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gguf import GEMMA3, LLAMA, PHI3, QWEN2, QWEN3, write_tiny_model

    folder.mkdir(parents=True, exist_ok=True)
    small = {"n_layers": 1, "dim": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}
    llama = replace(LLAMA, **small)
    specs = {
        "llama": llama,
        "qwen2": replace(QWEN2, **small),
        "qwen3": replace(QWEN3, **small, head_dim=16),
        "phi3": replace(PHI3, **small),
        "gemma3": replace(GEMMA3, **{**small, "n_layers": 2}),
        "template": replace(llama, chat_template=SEED_TEMPLATE),
        "bpe": replace(llama, tokenizer="gpt2", chat_template=SEED_TEMPLATE),
    }
    for qtype in (Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.F32):
        specs[f"llama-{qtype.name}"] = replace(llama, weight_type=qtype)
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # K-quant rows are 256 values
        specs[f"llama-{qtype.name}"] = replace(
            llama, dim=256, ffn_dim=256, n_heads=4, head_dim=64, weight_type=qtype
        )
    return [write_tiny_model(folder / f"seed-{name}.gguf", spec) for name, spec in specs.items()]


# Words libFuzzer splices into inputs: key names and values the readers compare against in
# C++ or in ways its comparison tracing does not see.
DICTIONARY = [
    "general.architecture",
    "general.alignment",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
    "llama",
    "gpt2",
    "t5",
    "bert",
    "rwkv",
    "plamo2",
    "no_vocab",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma3",
    "smollm",
    "<0x0A>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "{{",
    "}}",
    "{%",
    "%}",
    "range(",
    "__class__",
    "rope.scaling.type",
    "linear",
    "yarn",
    "attention.head_count_kv",
    "block_count",
    "rope_freqs.weight",
    "output.weight",
    "token_embd.weight",
]


def write_dictionary(path: Path) -> Path:
    lines = []
    for word in DICTIONARY:
        escaped = "".join(
            c if c.isalnum() or c in "._<>|{}%()/ " else f"\\x{ord(c):02x}" for c in word
        )
        lines.append(f'"{escaped}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--corpus", type=Path, default=Path("build/fuzz/corpus"))
    parser.add_argument("--crashes", type=Path, default=Path("build/fuzz/crashes"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    write_seeds(args.corpus)
    args.crashes.mkdir(parents=True, exist_ok=True)
    dictionary = write_dictionary(args.corpus.parent / "gguf.dict")
    # The vocabulary probe remembers the files it passed: keep that out of the user's cache.
    os.environ["MINIAPP_CACHE_DIR"] = tempfile.mkdtemp(prefix="miniapp-fuzz-cache-")
    scratch = Path(tempfile.mkdtemp(prefix="miniapp-fuzz-", dir="/dev/shm")) / "input.gguf"

    def one_input(data: bytes) -> None:
        scratch.write_bytes(data)
        try:
            load_to_first_token(scratch)
        except MiniappError as exc:
            if "\n" in str(exc).strip():
                raise AssertionError(f"a bad file's error is more than one line: {exc}") from exc

    libfuzzer = [
        sys.argv[0],
        str(args.corpus),
        f"-max_total_time={int(args.minutes * 60)}",
        "-timeout=20",
        "-rss_limit_mb=3072",
        "-max_len=400000",
        "-print_final_stats=1",
        f"-artifact_prefix={args.crashes}/",
        f"-dict={dictionary}",
    ]
    started = time.monotonic()
    atheris.Setup(libfuzzer, one_input)
    print(f"fuzzing the GGUF path for {args.minutes:g} minutes", flush=True)
    try:
        atheris.Fuzz()
    finally:
        print(f"ran {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
