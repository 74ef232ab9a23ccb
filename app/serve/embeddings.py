"""`POST /v1/embeddings` (OpenAI's shape) and `POST /v1/rerank` (the shape llama-server and
vLLM share, also at /rerank), on the served model.

Embeddings are the model's final-normed hidden states, pooled over each text and scaled to
unit length (engine/runtimes/embedding.py): the pooling the GGUF names, `--pooling`, or
mean. A text gets the same vector alone or in any batch. `dimensions` is refused: no GGUF
says that a model was trained to be cut short (Matryoshka), so a shorter vector would be
a guess. An embedding model (Qwen3-Embedding, for one) gives vectors made for search; a chat
model's are usable for rough similarity only.

Rerank asks the model, for each document, whether it answers the query, and scores it by
the probability of "yes" against "no" in the model's next token (engine/chat/relevance.py;
the method reranker models such as Qwen3-Reranker are trained for). Which models give
meaningful scores: `miniapp eval rerank` measures it (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from miniapp.engine.api import MiniappError, Pooling, Runtime, judgement_prompt, relevance

from .errors import bad_request
from .service import ServedModel, check_fits

MAX_INPUTS = 2048  # texts one embeddings request may send (OpenAI's own limit)
MAX_DOCUMENTS = 256  # documents one rerank request may score


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingsRequest(_Body):
    model: str
    # A text, texts, token ids, or lists of token ids (one vector each).
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and all(isinstance(item, int) for item in given):
            return [list(given)]
        return list(given)


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True


def embeddings_router(served: ServedModel, pooling: str | None) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    def embeddings(body: EmbeddingsRequest) -> JSONResponse:
        served.check_model(body.model)
        if body.dimensions is not None:
            raise bad_request(
                "this model does not support 'dimensions' (its file does not say it was "
                "trained to be shortened); leave it out",
                "dimensions",
                code="unsupported_parameter",
            )
        with served.using(body.model) as lease:
            runtime = lease.runtime
            prompts = _prompts(runtime, body.inputs())
            chosen = Pooling(pooling) if pooling else runtime.default_pooling()
            vectors = _on_engine(served, lambda: runtime.embed(prompts, chosen))
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(p) for p in prompts)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": lease.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    # Plain functions: FastAPI runs them on worker threads, which wait for the engine's thread.
    def rerank(body: RerankRequest) -> JSONResponse:
        if body.model is not None:
            served.check_model(body.model)
        with served.using(body.model) as lease:
            runtime = lease.runtime
            prompts = [_judgement_prompt(served, runtime, body.query, d) for d in body.documents]
            scores = _on_engine(served, lambda: relevance(runtime, prompts))
        ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: body.top_n]
        results = []
        for index in ranked:
            result = {"index": index, "relevance_score": scores[index]}
            if body.return_documents:
                result["document"] = {"text": body.documents[index]}
            results.append(result)
        tokens = sum(len(p) for p in prompts)
        return JSONResponse(
            {
                "id": "rerank",
                "object": "list",
                "model": lease.model_id,
                "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    for path in ("/v1/rerank", "/rerank", "/v1/reranking"):  # llama-server's names, vLLM's
        router.add_api_route(path, rerank, methods=["POST"])
    return router


def _prompts(runtime: Runtime, inputs: list[str | list[int]]) -> list[list[int]]:
    if not inputs:
        raise bad_request("'input' must hold at least one text", "input")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"'input' may hold at most {MAX_INPUTS} texts", "input")
    tokenizer, prompts = runtime.tokenizer, []
    for given in inputs:
        if isinstance(given, str):
            prompt = tokenizer.encode(given)
        else:
            prompt = list(given)
            if any(not 0 <= t < tokenizer.n_vocab for t in prompt):
                raise bad_request(f"token ids must be in 0..{tokenizer.n_vocab - 1}", "input")
        if not prompt:
            raise bad_request("'input' may not hold an empty text", "input")
        check_fits(runtime, prompt, "input")
        prompts.append(prompt)
    return prompts


def _on_engine(served: ServedModel, job):
    """`job`'s result, computed on the engine's thread (between the batching engine's
    steps, not beside them); what the engine refuses is a 400 naming why."""
    try:
        return served.host.compute.call(job)
    except MiniappError as exc:
        raise bad_request(str(exc)) from None


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _judgement_prompt(served: ServedModel, runtime: Runtime, query: str, document: str):
    prompt = judgement_prompt(runtime, served.template(runtime), query, document)
    check_fits(runtime, prompt, "documents")
    return prompt
