"""Embeddings served over HTTP: `miniapp serve`'s /v1/embeddings beside llama-server's
(`--embeddings`) on the same GGUF, threads and pooling, each a process of its own.

The texts are made here from a fixed seed (sentences of common words, 8 to 160 words), so
both servers embed exactly the same inputs. Throughput is texts a second over the whole set,
sent `batch` texts to a request by one client, the median of `repeats` passes after a
warm-up pass. Agreement is the cosine between the two servers' vectors of each text.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from .api_server_bench import ApiServer
from .llama_server_bench import HTTP_TIMEOUT, LlamaServer, ServerProcess

WORDS = (
    "the a of and to in is was for on that with as by at from it an be this which or are "
    "river city model token window memory engine answer question small large quick slow "
    "paris london music paper garden winter summer morning night water light stone tree "
    "read write build test measure count learn teach travel carry open close start end"
).split()


def sample_texts(count: int, seed: int = 7) -> list[str]:
    """`count` texts of 8 to 160 words, the same for a given seed."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 160))]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


@dataclass
class EmbeddingFigures:
    texts_per_s: float  # median of the passes
    passes_s: list[float]
    batch: int
    tokens: int  # the server's own count over the set


def embed_all(server: ServerProcess, model: str, texts: list[str], batch: int) -> tuple:
    """The set's vectors, `batch` texts a request, in order; and the tokens counted."""
    vectors, tokens = [], 0
    with httpx.Client(timeout=HTTP_TIMEOUT, trust_env=False) as client:
        for start in range(0, len(texts), batch):
            body = {"model": model, "input": texts[start : start + batch]}
            response = client.post(f"{server.url}/v1/embeddings", json=body)
            if response.status_code != 200:
                server.check_running("embedding")
                raise RuntimeError(f"{server.name}: {response.status_code} {response.text}")
            answer = response.json()
            ordered = sorted(answer["data"], key=lambda item: item["index"])
            vectors.extend(item["embedding"] for item in ordered)
            tokens += answer.get("usage", {}).get("prompt_tokens", 0)
    return np.array(vectors, dtype=np.float32), tokens


def measure(
    server: ServerProcess, model: str, texts: list[str], batch: int, repeats: int
) -> tuple[EmbeddingFigures, np.ndarray]:
    vectors, tokens = embed_all(server, model, texts, batch)  # warm-up, and the vectors
    passes = []
    for _ in range(repeats):
        started = time.perf_counter()
        embed_all(server, model, texts, batch)
        passes.append(time.perf_counter() - started)
    median = statistics.median(passes)
    return EmbeddingFigures(len(texts) / median, passes, batch, tokens), vectors


def compare_servers(
    binary: Path,
    model: Path,
    threads: int,
    ctx: int,
    pooling: str,
    batches: list[int],
    count: int,
    repeats: int,
) -> dict:
    """Both servers' figures for each batch size, and how close their vectors are."""
    texts = sample_texts(count)
    report: dict = {"texts": count, "pooling": pooling, "threads": threads, "runs": {}}
    vectors = {}
    ours = ApiServer(model, 2, ctx, threads, "f16")
    ours.command += ["--pooling", pooling]
    theirs = LlamaServer(binary, model, 1, ctx, threads)
    theirs.command += ["--embeddings", "--pooling", pooling, "-b", str(ctx), "-ub", str(ctx)]
    for name, server in (("miniapp", ours), ("llama-server", theirs)):
        with server:
            rows = {}
            for batch in batches:
                figures, vectors[name] = measure(server, model.name, texts, batch, repeats)
                rows[str(batch)] = asdict(figures)
            report["runs"][name] = rows
            report[f"{name}_command"] = " ".join(server.command)
            report[f"{name}_peak_rss_mb"] = server.peak_rss_mb()
    a, b = vectors["miniapp"], vectors["llama-server"]
    cosine = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    report["cosine_min"], report["cosine_median"] = float(cosine.min()), float(np.median(cosine))
    return report
