"""LoRA adapters through `miniapp serve` (issue 51): a real server process on loopback (the
bundled SmolLM2 on the batching engine), driven by the official `openai` package and, for
the load and unload endpoints, by httpx. Requests pick adapters by `model` or by
llama-server's `lora` field; adapters load and unload while the server runs, from the
adapters folder only; unloading one that streams are using never breaks them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve import MODEL, running_server, wait_ready
from tiny_gguf import LLAMA, write_tiny_adapter, write_tiny_model

from miniapp.engine.api import (
    GREEDY,
    GenerationRequest,
    LoraChoice,
    TextDelta,
    generate,
    resolve_model,
)

KEY = "lora-key"
AUTH = {"authorization": f"Bearer {KEY}"}
QUESTION = "Name three rivers."
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The adapters folder (--lora-dir) with adapters for SmolLM2, and a folder beside it."""
    root = tmp_path_factory.mktemp("serve_lora")
    folder, outside = root / "adapters", root / "elsewhere"
    folder.mkdir()
    outside.mkdir()
    base = resolve_model(MODEL)
    for name, seed in (("first", 1), ("second", 2), ("third", 3), ("fourth", 4)):
        write_tiny_adapter(folder / f"{name}.gguf", base, rank=4, alpha=2.0, seed=seed)
    write_tiny_adapter(outside / "stray.gguf", base, rank=4, alpha=2.0, seed=5)
    (folder / "notes.gguf").write_text("not a GGUF file at all\n")
    tiny = write_tiny_model(root / "tiny.gguf", LLAMA)
    write_tiny_adapter(folder / "for_tiny.gguf", tiny)  # another base's adapter
    (folder / "link.gguf").symlink_to(outside / "stray.gguf")
    return folder, outside


@pytest.fixture(scope="module")
def server(miniapp_exe, folders):
    """One server for the module: adapter `first` loaded at start (at scale 1), the others
    loaded by the tests from --lora-dir; four slots, behind a key."""
    folder, _ = folders
    flags = (
        "--parallel",
        "4",
        "--api-key",
        KEY,
        "--lora",
        f"first={folder / 'first.gguf'}",
        "--lora-dir",
        str(folder),
    )
    with running_server(miniapp_exe, *flags) as (_, base):
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def post(base: str, path: str, body: dict, auth: bool = True) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=AUTH if auth else {}, timeout=60)


def load(base: str, name: str, path: str | Path) -> httpx.Response:
    return post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(base: str, name: str) -> httpx.Response:
    return post(base, "/v1/unload_lora_adapter", {"lora_name": name})


def ask(client, model: str = MODEL, content: str = QUESTION, **options) -> str:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=options.pop("max_tokens", 24),
        **options,
    )
    return response.choices[0].message.content


def complete(client, model: str = MODEL, **options) -> str:
    response = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=24, **options
    )
    return response.choices[0].text


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    response = httpx.get(base + "/metrics", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


# ------------------------------------------------------------------ listing and picking


def test_the_models_list_and_lora_adapters_name_each_adapter_with_its_parent(server, folders):
    listed = httpx.get(server + "/v1/models", headers=AUTH).json()["data"]
    assert listed[0]["id"] == MODEL and "parent" not in listed[0]
    adapter = listed[1]
    assert adapter["id"] == "first" and adapter["parent"] == MODEL
    assert adapter["object"] == "model" and adapter["context_length"] == 1024
    adapters = httpx.get(server + "/lora-adapters", headers=AUTH).json()
    assert adapters[0] == {
        "id": 0,
        "name": "first",
        "path": str(folders[0] / "first.gguf"),
        "scale": 1.0,
    }


def test_an_adapter_picked_by_model_or_by_the_lora_field_gives_the_engines_answer(
    client, torch_runtime, folders
):
    base = ask(client)
    by_model = client.chat.completions.create(
        model="first",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
    )
    assert by_model.model == "first"  # as vLLM answers
    adapted = by_model.choices[0].message.content
    assert adapted != base
    assert ask(client, extra_body={"lora": [{"name": "first"}]}) == adapted
    assert ask(client, extra_body={"lora": [{"id": 0, "scale": 1.0}]}) == adapted
    assert ask(client, "first", extra_body={"lora": [{"id": 0, "scale": 0}]}) == base  # 0: off
    assert ask(client, extra_body={"lora": [{"id": 0, "scale": 0.5}]}) not in (base, adapted)
    assert ask(client, extra_body={"lora": []}) == base
    # The engine alone, with the same adapter, gives the server's text answer.
    torch_runtime.lora.load("first", folders[0] / "first.gguf")
    try:
        engine_text = _engine_completion(torch_runtime, "first")
    finally:
        torch_runtime.lora.unload("first")
    served = complete(client, "first")
    assert served == engine_text and served != complete(client)


def _engine_completion(runtime, adapter: str) -> str:
    sampling = dataclasses.replace(GREEDY, lora=(LoraChoice(adapter),))
    request = GenerationRequest(max_tokens=24, sampling=sampling)
    events = generate(runtime, runtime.tokenizer.encode(PROMPT), request, lambda: False)
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def test_unknown_adapters_are_404s_and_a_malformed_lora_field_is_a_400(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist") as info:
        ask(client, "nobody")
    assert info.value.body["code"] == "model_not_found"
    for field, param in (([{"name": "nobody"}], "lora.0"), ([{"id": 40}], "lora.0.id")):
        with pytest.raises(openai.NotFoundError, match="loaded: 0 first") as info:
            ask(client, extra_body={"lora": field})
        assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == param
    for field in (
        "first",
        [{"scale": 1}],
        [{"id": 0, "name": "first"}],
        [{"id": -1}],
        [{"id": 0, "scale": 1e9}],
        [{"id": 0, "weight": 1}],
        [{"id": 0}, {"name": "first"}],  # the same adapter twice
    ):
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, extra_body={"lora": field})
        assert info.value.body["param"].startswith("lora"), field


# ------------------------------------------------------------------ loading and unloading


def test_an_adapter_loaded_at_run_time_answers_until_it_is_unloaded(server, client, folders):
    folder, _ = folders
    before = scrape(server)
    response = load(server, "second", "second.gguf")  # relative to the adapters folder
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'second' added successfully."
    assert load(server, "third", folder / "third.gguf").status_code == 200  # absolute
    ids = {a["name"]: a["id"] for a in httpx.get(server + "/lora-adapters", headers=AUTH).json()}
    assert ids == {"first": 0, "second": 1, "third": 2}
    listed = [m["id"] for m in httpx.get(server + "/v1/models", headers=AUTH).json()["data"]]
    assert listed[:4] == [MODEL, "first", "second", "third"]

    second = ask(client, "second")
    assert second not in (ask(client), ask(client, "first"))
    assert ask(client, extra_body={"lora": [{"id": ids["second"]}]}) == second
    both = ask(client, extra_body={"lora": [{"name": "second"}, {"name": "third"}]})
    assert both not in (second, ask(client, "third"))
    after = scrape(server)
    figures = {name: after[(name, (("adapter", "second"),))] for name in _ADAPTER_GAUGES}
    assert figures["miniapp_lora_adapter_bytes"] > 0
    assert 0 < figures["miniapp_lora_adapter_load_seconds"] < 5
    assert figures["miniapp_lora_adapter_loads"] == 1
    requests = after[("miniapp_lora_requests_total", (("adapter", "second"),))]
    assert requests - before.get(("miniapp_lora_requests_total", (("adapter", "second"),)), 0) == 3

    response = unload(server, "second")
    assert response.status_code == 200 and "'second' removed" in response.text
    for field in ({}, {"extra_body": {"lora": [{"name": "second"}]}}):
        with pytest.raises(openai.NotFoundError):
            ask(client, "second" if not field else MODEL, **field)
    gone = scrape(server)
    assert ("miniapp_lora_adapter_bytes", (("adapter", "second"),)) not in gone
    missing = unload(server, "second")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert unload(server, "third").status_code == 200


_ADAPTER_GAUGES = (
    "miniapp_lora_adapter_bytes",
    "miniapp_lora_adapter_load_seconds",
    "miniapp_lora_adapter_loads",
)


def test_paths_outside_the_adapters_folder_are_403_and_bad_files_400(server, folders):
    folder, outside = folders
    for path in (
        outside / "stray.gguf",
        "../elsewhere/stray.gguf",
        folder / ".." / "elsewhere" / "stray.gguf",
        "link.gguf",  # a link inside the folder to a file outside it
        "/etc/passwd",
    ):
        response = load(server, "stray", path)
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["param"] == "lora_path"
    for path, why in (
        ("notes.gguf", "notes.gguf"),
        ("for_tiny.gguf", "for_tiny.gguf"),
        ("absent.gguf", "no such adapter file"),
        (resolve_model(MODEL), None),  # a model, not an adapter: outside the folder
    ):
        response = load(server, "bad", path)
        if why is None:
            assert response.status_code == 403
            continue
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert why in message and "\n" not in message
    taken = load(server, "first", "fourth.gguf")
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
    assert load(server, MODEL, "fourth.gguf").status_code == 400  # the base model's name
    names = [a["name"] for a in httpx.get(server + "/lora-adapters", headers=AUTH).json()]
    assert "stray" not in names and "bad" not in names


def test_load_and_unload_need_the_key(server):
    body = {"lora_name": "fourth", "lora_path": "fourth.gguf"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/lora-adapters"):
        response = post(server, path, body, auth=False)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_unloading_an_adapter_that_streams_use_never_breaks_them(server, client):
    """Four streams with an adapter; it is unloaded while they run: each ends with the text
    it gives uninterrupted, and new requests for it are 404s."""
    assert load(server, "fourth", "fourth.gguf").status_code == 200
    questions = ("Write a long story about a dragon.", "Describe the sea in detail.")
    options = {"max_tokens": 64, "extra_body": {"ignore_eos": True}}
    expected = {q: ask(client, "fourth", q, **options) for q in questions}
    streams = [
        client.chat.completions.create(
            model="fourth",
            messages=[{"role": "user", "content": q}],
            temperature=0,
            stream=True,
            **options,
        )
        for q in questions * 2
    ]
    texts, ends = [], []
    for stream in streams:  # each has begun
        for chunk in stream:
            if chunk.choices[0].delta.content:
                texts.append(chunk.choices[0].delta.content)
                break
    assert unload(server, "fourth").status_code == 200
    assert scrape(server)[("miniapp_requests_running", ())] > 0  # unloaded mid-stream
    with pytest.raises(openai.NotFoundError):
        ask(client, "fourth")
    for number, stream in enumerate(streams):
        for chunk in stream:
            texts[number] += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                ends.append(chunk.choices[0].finish_reason)
    assert ends == ["length"] * 4
    assert texts == [expected[q] for q in questions * 2]


# ------------------------------------------------------------------ the adapters folder


def test_the_adapters_folder_defaults_to_the_models_folders_and_resolves_links(
    tmp_path, monkeypatch
):
    from app.serve.errors import ApiError
    from app.serve.lora import adapters_folder, allowed_path

    monkeypatch.setenv("MINIAPP_MODELS_DIR", str(tmp_path / "models"))
    assert adapters_folder(None) == (tmp_path / "models" / "adapters").resolve()
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "linked")
    folder = adapters_folder(tmp_path / "linked")
    assert folder == (tmp_path / "real").resolve()
    assert allowed_path(folder, "a.gguf") == folder / "a.gguf"
    assert allowed_path(folder, str(tmp_path / "linked" / "b.gguf")) == folder / "b.gguf"
    with pytest.raises(ApiError) as info:
        allowed_path(folder, "sub/../../x.gguf")
    assert info.value.status == 403


# ------------------------------------------------------------------ llama.cpp


def test_llamacpp_serves_the_adapter_it_was_opened_with_and_nothing_more(miniapp_exe, folders):
    folder, _ = folders
    flags = ("--backend", "llamacpp", "--lora", f"first={folder / 'first.gguf'}")
    with running_server(miniapp_exe, *flags) as (_, base):
        wait_ready(base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        listed = client.models.list().data
        assert [m.id for m in listed[:2]] == [MODEL, "first"]
        answer = ask(client, "first")
        assert ask(client, extra_body={"lora": [{"id": 0, "scale": 1}]}) == answer
        assert ask(client) == answer  # applied to every answer
        with pytest.raises(openai.BadRequestError, match="other scales need --backend torch"):
            ask(client, extra_body={"lora": [{"name": "first", "scale": 0.5}]})
        with pytest.raises(openai.NotFoundError):
            ask(client, "second")
        refused = httpx.post(
            base + "/v1/load_lora_adapter",
            json={"lora_name": "second", "lora_path": "second.gguf"},
        )
        assert refused.status_code == 400 and "--backend torch" in refused.text
