"""llama-server's POST /tokenize and POST /detokenize (vLLM serves the same paths): the loaded
model's own tokenizer, so that a client counts tokens, or turns ids back into text, exactly as
the model sees them.

/tokenize takes llama-server's fields (`content`, `add_special`, `parse_special`,
`with_pieces`) and answers `{"tokens": [...]}` (with `with_pieces`, `{"id", "piece"}` for
each, the piece as text, or as its bytes where they are not UTF-8 on their own); vLLM's
`prompt` and `add_special_tokens` are taken too, and answered in vLLM's shape (`count`,
`max_model_len`, `tokens`). /detokenize takes `{"tokens": [...]}` and answers with the text
under both names, llama-server's `content` and vLLM's `prompt`. Special tokens are written
out as their text, as llama-server's are.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from .errors import bad_request
from .service import ServedModel


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Body):
    model: str | None = None
    content: str | None = None  # llama-server's name
    prompt: str | None = None  # vLLM's
    add_special: bool = False  # llama-server: BOS where the model adds one
    add_special_tokens: bool | None = None  # vLLM's (its default: true)
    parse_special: bool = True  # "<|im_end|>" in the text is that token
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def tokens_router(served: ServedModel) -> APIRouter:
    router = APIRouter()

    # The lease is held while the tokenizer is used: a model let go meanwhile (llama.cpp's
    # runtime frees its vocabulary on close) must not be read.
    @router.post("/tokenize")
    def tokenize(body: TokenizeRequest) -> JSONResponse:
        if (body.content is None) == (body.prompt is None):
            raise bad_request("give the text as `content` (or vLLM's `prompt`), once", "content")
        with served.using(body.model) as lease:
            return _tokenized(body, lease.runtime)

    @router.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> JSONResponse:
        with served.using(body.model) as lease:
            return _detokenized(body, lease.runtime.tokenizer)

    return router


def _piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not UTF-8 on their own (part of a
    character), as llama-server writes them."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _tokenized(body: TokenizeRequest, runtime) -> JSONResponse:
    tokenizer = runtime.tokenizer
    vllm = body.prompt is not None
    if vllm:
        add, text = body.add_special_tokens is not False, body.prompt
    else:
        add, text = body.add_special, body.content
    ids = tokenizer.encode(
        text, add_bos=add and tokenizer.add_bos, parse_special=body.parse_special
    )
    if body.with_pieces:
        tokens = [{"id": t, "piece": _piece(tokenizer.token_bytes(t, special=True))} for t in ids]
    else:
        tokens = ids
    if vllm:
        return JSONResponse({"count": len(ids), "max_model_len": runtime.n_ctx, "tokens": tokens})
    return JSONResponse({"tokens": tokens})


def _detokenized(body: DetokenizeRequest, tokenizer) -> JSONResponse:
    vocab = tokenizer.n_vocab
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is not in 0..{vocab - 1}", "tokens")
    text = b"".join(tokenizer.token_bytes(t, special=True) for t in body.tokens)
    content = text.decode("utf-8", "replace")
    return JSONResponse({"content": content, "prompt": content})
