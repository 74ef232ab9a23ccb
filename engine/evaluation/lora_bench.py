"""`miniapp bench lora`: what LoRA adapters cost the torch engine, beside llama.cpp's cost for
the same adapter on the same file and threads.

- load: reading, checking and binding a rank-R adapter (median of several loads);
- lone decode: the base alone against the base with one adapter on every projection,
  runs interleaved so that both see the same machine state, medians;
- mixed batches: C clients on A different adapters against the same C clients on the base
  (aggregate tok/s), every answer checked against its lone run.

The adapters are random (seeded), as llama.cpp's converter lays them out: f16 A [r, in] and
B [out, r] for q, k, v, o, gate, up and down (Phi-3's fused tensors where it has them).
Speed does not depend on the values.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from ..lora.registry import LoraSpec
from ..modelfile.gguf_file import GGUFFile
from ..runtimes.llamacpp_runtime import LlamaCppRuntime
from ..runtimes.torch_runtime import TorchRuntime
from ..tokens.sampling import GREEDY, LoraChoice, SamplingParams
from .serving import run_clients

ADAPTED = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up")
ADAPTED += ("ffn_down",)


def write_random_adapter(
    base: Path, path: Path, rank: int = 16, seed: int = 0, dtype=np.float16, alpha: float = 32.0
) -> Path:
    """A random LoRA adapter for `base` on every projection of every layer."""
    model = GGUFFile(base)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), model.architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, info in model.tensors.items():
        parts = name.split(".")
        if not name.startswith("blk.") or parts[-1] != "weight" or parts[-2] not in ADAPTED:
            continue
        outputs, inputs = info.shape
        a = rng.normal(0.0, 1 / np.sqrt(inputs), size=(rank, inputs)).astype(dtype)
        b = rng.normal(0.0, 0.02, size=(outputs, rank)).astype(dtype)
        writer.add_tensor(name + ".lora_a", a)
        writer.add_tensor(name + ".lora_b", b)
    model.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class LoraBenchResult:
    model: str
    rank: int
    adapter_mb: float
    load_ms: float  # median
    base_tok_s: float  # lone decode, medians
    adapted_tok_s: float
    llamacpp_base_tok_s: float | None
    llamacpp_adapted_tok_s: float | None
    clients: int
    adapters: int
    batch_base_tok_s: float  # aggregate
    batch_mixed_tok_s: float
    identical: bool  # every batched answer equals its lone run

    @property
    def decode_cost(self) -> float:
        """Extra time a token takes with the adapter (0.1: 10% slower)."""
        return self.base_tok_s / self.adapted_tok_s - 1

    @property
    def llamacpp_cost(self) -> float | None:
        if not self.llamacpp_base_tok_s or not self.llamacpp_adapted_tok_s:
            return None
        return self.llamacpp_base_tok_s / self.llamacpp_adapted_tok_s - 1

    @property
    def mixed_ratio(self) -> float:
        return self.batch_mixed_tok_s / self.batch_base_tok_s

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(
            decode_cost=self.decode_cost,
            llamacpp_cost=self.llamacpp_cost,
            mixed_ratio=self.mixed_ratio,
        )
        return data


def bench_lora(
    model: Path,
    rank: int = 16,
    threads: int | None = None,
    tokens: int = 128,
    repeat: int = 5,
    prompt_tokens: int = 64,
    clients: int = 8,
    adapters: int = 4,
    llamacpp: bool = True,
) -> LoraBenchResult:
    with tempfile.TemporaryDirectory(prefix="miniapp-lora-bench-") as folder:
        paths = [
            write_random_adapter(model, Path(folder) / f"a{i}.gguf", rank, seed=i)
            for i in range(adapters)
        ]
        return _bench(model, paths, rank, threads, tokens, repeat, prompt_tokens, clients, llamacpp)


def _bench(model, paths, rank, threads, tokens, repeat, prompt_tokens, clients, llamacpp):
    runtime = TorchRuntime(model, n_ctx=1024, threads=threads, spec="off", parallel=clients)
    vocab = runtime.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, min(vocab, 20000), prompt_tokens).tolist() for _ in range(8)]
    load_ms = _load_ms(runtime, paths[0])
    names = []
    for index, path in enumerate(paths):
        names.append(f"a{index}")
        runtime.lora.load(names[-1], path)
    adapter_mb = runtime.lora.get(names[0]).nbytes / 2**20
    base_runs, adapted_runs = [], []
    for run in range(repeat):
        prompt = prompts[run % len(prompts)]
        base_runs.append(_decode(runtime, prompt, tokens, ()))
        adapted_runs.append(_decode(runtime, prompt, tokens, (LoraChoice(names[0]),)))
    lone = {}
    choice_of = [(LoraChoice(names[c % len(names)]),) for c in range(clients)]
    for c in range(clients):
        lone[c] = _answer(runtime, prompts[c % len(prompts)], tokens, choice_of[c])
    base_batch, _ = _batch(runtime, prompts, tokens, [()] * clients, None)
    mixed_batch, identical = _batch(runtime, prompts, tokens, choice_of, lone)
    runtime.close()
    llama_base = llama_adapted = None
    if llamacpp:
        llama_base, llama_adapted = _llamacpp(model, paths[0], threads, prompts, tokens, repeat)
    return LoraBenchResult(
        model.name,
        rank,
        adapter_mb,
        load_ms,
        statistics.median(base_runs),
        statistics.median(adapted_runs),
        llama_base,
        llama_adapted,
        clients,
        len(paths),
        base_batch,
        mixed_batch,
        identical,
    )


def _load_ms(runtime: TorchRuntime, path: Path, times: int = 5) -> float:
    seconds = []
    for _ in range(times):
        info = runtime.lora.load("timed", path)
        seconds.append(info.load_seconds)
        runtime.lora.unload("timed")
    return statistics.median(seconds) * 1000


def _params(choices) -> SamplingParams:
    return dataclasses.replace(GREEDY, lora=tuple(choices))


def _decode(runtime: TorchRuntime, prompt: list[int], tokens: int, choices) -> float:
    """Decode tok/s of one greedy answer from a fresh cache (the first token excluded)."""
    runtime.reset()
    stream = runtime.generate_tokens(prompt, _params(choices))
    times = []
    try:
        for _ in stream:
            times.append(time.perf_counter())
            if len(times) == tokens:
                break
    finally:
        stream.close()
    return (len(times) - 1) / (times[-1] - times[0])


def _answer(runtime: TorchRuntime, prompt, tokens: int, choices) -> list[int]:
    runtime.reset()
    stream = runtime.generate_tokens(prompt, _params(choices))
    try:
        return [token for token, _ in zip(stream, range(tokens), strict=False)]
    finally:
        stream.close()


def _batch(runtime: TorchRuntime, prompts, tokens: int, choices, lone) -> tuple[float, bool]:
    """Aggregate tok/s of len(choices) clients at once, client c with choices[c]; and
    whether every answer equals its lone run."""
    runtime.reset()
    scheduler = runtime.scheduler
    answers: dict[int, list[int]] = {}

    def stream(index: int) -> Iterable[int]:
        tokens_of = runtime.generate_tokens(prompts[index % len(prompts)], _params(choices[index]))
        got = []
        try:
            for token in tokens_of:
                got.append(token)
                yield token
                if len(got) == tokens:
                    break
        finally:
            tokens_of.close()
            answers[index] = got

    stop, outcome = threading.Event(), {}

    def launch() -> None:
        try:
            while not scheduler.serving:
                time.sleep(0.001)
            outcome["run"] = run_clients(len(choices), 1, len(choices), stream)
        except BaseException as exc:  # re-raised on the main thread
            outcome["error"] = exc
        finally:
            stop.set()

    launcher = threading.Thread(target=launch)
    launcher.start()
    scheduler.serve(stop)
    launcher.join()
    if "error" in outcome:
        raise outcome["error"]
    done, wall = outcome["run"]
    generated = sum(len(r.tokens) for r in done)
    identical = lone is None or all(answers[c] == lone[c] for c in answers)
    return generated / wall, identical


def _llamacpp(model, adapter, threads, prompts, tokens, repeat) -> tuple[float, float]:
    """llama.cpp's lone decode without and with the adapter (unmerged, as it applies one)."""
    speeds = {}
    for name, lora in (("base", ()), ("adapted", (LoraSpec("a", adapter),))):
        runtime = LlamaCppRuntime(model, n_ctx=1024, threads=threads, lora=lora)
        runs = [_decode(runtime, prompts[r % len(prompts)], tokens, ()) for r in range(repeat)]
        speeds[name] = statistics.median(runs)
        runtime.close()
    return speeds["base"], speeds["adapted"]
