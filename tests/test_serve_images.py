"""Images in `miniapp serve`'s chat messages (`image_url` parts with base64 data URIs): read by
OCR into the prompt for a model without a projector, shown to the vision model (llama.cpp
with the projector beside the model) otherwise; bad images are 400s naming the cause."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
from image_fixtures import TinyProjector, encode, text_image, write_tiny_projector
from PIL import Image
from test_serve import MODEL, running_server, wait_ready
from tiny_gguf import LLAMA, write_tiny_model

from miniapp.engine.images import attach_image, build_user_message, choose_route
from miniapp.engine.modelfile.template import ChatTemplate, Message
from miniapp.engine.tokens.tokenizer import Tokenizer

QUESTION = "What does the sign say?"


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def with_image(url: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def ocr_server(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "2") as (_, base):
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(ocr_server):
    return openai.OpenAI(base_url=ocr_server + "/v1", api_key="unused", max_retries=0)


def test_an_image_is_read_by_ocr_into_the_prompt(client, default_model):
    png = encode(text_image(["OPEN 9 TO 5"]), "PNG")
    answer = client.chat.completions.create(
        model=MODEL, messages=with_image(data_uri(png)), max_tokens=4, temperature=0
    )
    assert answer.choices[0].message.content is not None
    # The prompt the server evaluated is the chat's own: OCR's labelled line, then the text.
    route = choose_route(default_model, "torch")
    content = build_user_message(QUESTION, [attach_image(png, route, name="image 1")])
    assert "OPEN 9 TO 5" in content
    tokenizer = Tokenizer(default_model)
    template = ChatTemplate.for_model(_template(default_model), tokenizer, "llama")
    expected = tokenizer.encode_chat(template.render([Message("user", content)]))
    assert answer.usage.prompt_tokens == len(expected)


def _template(model):
    from miniapp.engine.modelfile.gguf_file import GGUFFile

    return GGUFFile(model).metadata.get("tokenizer.chat_template")


@pytest.mark.parametrize(
    ("url", "code", "says"),
    [
        ("https://example.com/cat.png", "invalid_image_url", "fetches nothing"),
        ("data:image/png;base64,@@@not-base64@@@", "invalid_image", "does not decode"),
        ("data:text/plain;base64,aGVsbG8=", "invalid_image", "not an image"),
        (data_uri(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40), "invalid_image", "image 1"),
    ],
    ids=["remote-url", "bad-base64", "not-an-image-type", "corrupt-png"],
)
def test_a_bad_image_is_a_400_naming_why(ocr_server, url, code, says):
    body = {"model": MODEL, "messages": with_image(url), "max_tokens": 2}
    response = httpx.post(ocr_server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and says in error["message"]
    assert error["param"].startswith("messages.0")


def test_only_user_messages_carry_images(ocr_server):
    png = encode(Image.new("RGB", (32, 32), "red"), "PNG")
    picture = {"type": "image_url", "image_url": {"url": data_uri(png)}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [picture]}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    response = httpx.post(ocr_server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.1"


def test_a_model_with_a_projector_is_shown_the_picture(miniapp_exe, tmp_path):
    write_tiny_model(tmp_path / "tiny.gguf", LLAMA)
    write_tiny_projector(tmp_path / "mmproj-tiny-f16.gguf", TinyProjector(text_dim=LLAMA.dim))
    flags = ("--model", str(tmp_path / "tiny.gguf"), "--ctx", "512")
    with running_server(miniapp_exe, *flags) as (_, base):
        wait_ready(base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        png = encode(Image.new("RGB", (96, 80), "blue"), "PNG")
        seen = client.chat.completions.create(
            model="tiny.gguf", max_tokens=4, temperature=0, messages=with_image(data_uri(png))
        )
        question = [{"role": "user", "content": QUESTION}]
        plain = client.chat.completions.create(
            model="tiny.gguf", max_tokens=4, temperature=0, messages=question
        )
        assert seen.choices[0].finish_reason in ("stop", "length")
        # The picture's embeddings take positions in the evaluated prompt; OCR text would not
        # (a plain blue square has none).
        assert seen.usage.prompt_tokens > plain.usage.prompt_tokens + 8
        with pytest.raises(openai.BadRequestError, match="logprobs are not reported"):
            client.chat.completions.create(
                model="tiny.gguf", max_tokens=2, logprobs=True, messages=with_image(data_uri(png))
            )
