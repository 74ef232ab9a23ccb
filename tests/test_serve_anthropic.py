"""Anthropic's Messages API on `miniapp serve` (app/serve/anthropic.py), through the official
`anthropic` package and raw HTTP (httpx) against a real server process on a loopback port,
answering with the bundled SmolLM2: the translation into the chat pipeline, the streamed
events' order, stop reasons, tool use, images, count_tokens and errors in Anthropic's shape.

The installed client no longer takes `temperature` as an argument; greedy answers send it
as an extra body field, as older clients and Claude Code do."""

from __future__ import annotations

import base64
import io
import itertools
import json
import re
import time

import anthropic
import httpx
import jsonschema
import pytest
from PIL import Image, ImageDraw
from test_serve import MODEL, running_server, wait_ready
from tool_schemas import TIME_ARGUMENTS, TIME_TEXT, WEATHER_ARGUMENTS, WEATHER_TEXT

GREEDY = {"temperature": 0}
SYSTEM = "You are a helpful assistant who answers briefly."
CONVERSATION = [
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red, green and blue."},
    {"role": "user", "content": "Name three more."},
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": WEATHER_TEXT,
    "input_schema": WEATHER_ARGUMENTS,
}
TIME = {"name": "get_time", "description": TIME_TEXT, "input_schema": TIME_ARGUMENTS}
# One call of get_time: the tests that use tools share its grammar, compiled once.
ONE_TIME_CALL = {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}
STREAM_ORDER = [
    "message_start",
    "content_block_start",
    "ping",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
]
KEY = "anthropic-sekret"


@pytest.fixture(scope="module")
def base(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "2") as (_, url):
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def claude(base) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)


def _message(claude, messages=CONVERSATION, extra_body=None, **options):
    options = {"max_tokens": 40, **options}
    extra = {**GREEDY, **(extra_body or {})}
    return claude.messages.create(model=MODEL, messages=messages, extra_body=extra, **options)


def _events(base: str, **body) -> list[tuple[str, dict]]:
    """A streamed message's events as raw server-sent events: (event name, data)."""
    body = {"model": MODEL, "max_tokens": 40, **GREEDY, **body, "stream": True}
    events = []
    with httpx.stream("POST", base + "/v1/messages", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name  # each event names its data's type
                events.append((name, data))
    return events


def _streamed_text(events: list[tuple[str, dict]]) -> str:
    return "".join(
        data["delta"]["text"]
        for name, data in events
        if name == "content_block_delta" and data["delta"]["type"] == "text_delta"
    )


def _final_delta(events: list[tuple[str, dict]]) -> dict:
    return next(data for name, data in events if name == "message_delta")


def test_a_greedy_message_is_the_chat_completions_answer_plain_and_streamed(base, claude):
    chat = httpx.post(
        base + "/v1/chat/completions",
        json={
            "model": MODEL,
            "max_tokens": 40,
            **GREEDY,
            "messages": [{"role": "system", "content": SYSTEM}, *CONVERSATION],
        },
        timeout=60,
    ).json()
    expected = chat["choices"][0]["message"]["content"]
    reason = {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]

    plain = _message(claude, system=SYSTEM)
    assert plain.type == "message" and plain.role == "assistant" and plain.model == MODEL
    assert plain.id.startswith("msg_")
    assert [block.type for block in plain.content] == ["text"]
    assert plain.content[0].text == expected
    assert plain.stop_reason == reason and plain.stop_sequence is None
    assert plain.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert plain.usage.output_tokens == chat["usage"]["completion_tokens"]

    with claude.messages.stream(
        model=MODEL, messages=CONVERSATION, system=SYSTEM, max_tokens=40, extra_body=GREEDY
    ) as stream:
        pieces = [event.text for event in stream if event.type == "text"]
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == expected
    assert final.content[0].text == expected and final.stop_reason == reason
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert final.usage.output_tokens == plain.usage.output_tokens

    events = _events(base, messages=CONVERSATION, system=SYSTEM)
    assert [name for name, _ in itertools.groupby(name for name, _ in events)] == STREAM_ORDER
    assert _streamed_text(events) == expected
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == plain.usage.input_tokens
    assert _final_delta(events)["delta"]["stop_reason"] == reason


def test_max_tokens_and_a_stop_sequence_end_the_message_as_anthropic_says(base, claude):
    long_story = [{"role": "user", "content": "Write a long story about a dragon."}]
    cut = _message(claude, long_story, max_tokens=6)
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None
    assert cut.usage.output_tokens == 6

    text = _message(claude).content[0].text
    word = re.findall(r"[A-Za-z]{3,}", text)[1]  # one the greedy answer writes after others
    stops = ["never-written-stop", word]
    stopped = _message(claude, stop_sequences=stops)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]

    events = _events(base, messages=CONVERSATION, stop_sequences=stops)
    final = _final_delta(events)["delta"]
    assert final == {"stop_reason": "stop_sequence", "stop_sequence": word}
    assert _streamed_text(events) == stopped.content[0].text


def test_a_named_tool_gives_a_tool_use_block_that_validates_plain_and_streamed(base, claude):
    options = {"tools": [WEATHER, TIME], "tool_choice": ONE_TIME_CALL, "max_tokens": 100}
    plain = _message(claude, ASK_WEATHER, **options)
    assert plain.stop_reason == "tool_use"
    (call,) = plain.content
    assert call.type == "tool_use" and call.name == "get_time" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, TIME["input_schema"])

    events = _events(base, messages=ASK_WEATHER, **options)
    assert [name for name, _ in itertools.groupby(name for name, _ in events)] == STREAM_ORDER
    (opened,) = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert opened["type"] == "tool_use" and opened["name"] == "get_time"
    assert opened["id"].startswith("toolu_") and opened["input"] == {}
    pieces = [
        data["delta"]["partial_json"]
        for name, data in events
        if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta"
    ]
    assert len(pieces) > 1  # the input arrives as the model writes it
    assert json.loads("".join(pieces)) == call.input
    assert _final_delta(events)["delta"]["stop_reason"] == "tool_use"

    with claude.messages.stream(
        model=MODEL, messages=ASK_WEATHER, extra_body=GREEDY, **options
    ) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_time", call.input)
    ]


def test_a_tool_result_goes_back_into_the_conversation_and_gets_a_text_answer(claude):
    tools = [WEATHER, TIME]
    first = _message(claude, ASK_WEATHER, tools=tools, tool_choice=ONE_TIME_CALL, max_tokens=100)
    (call,) = first.content
    used = {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}

    def conversation(result: str, **flags) -> list[dict]:
        answered = {"type": "tool_result", "tool_use_id": call.id, "content": result, **flags}
        return [
            *ASK_WEATHER,
            {"role": "assistant", "content": [used]},
            {"role": "user", "content": [answered]},
        ]

    def answer_given(result: str):
        no_call = {"type": "none"}
        return _message(
            claude, conversation(result), tools=tools, tool_choice=no_call, max_tokens=30
        )

    noon = answer_given("It is 12:00 in Paris, the sun is high and the cafes are busy.")
    assert [block.type for block in noon.content] == ["text"] and noon.content[0].text
    assert noon.stop_reason in ("end_turn", "max_tokens")
    assert noon.usage.input_tokens >= answer_given("").usage.input_tokens + 8

    def counted(**flags) -> int:
        messages = conversation("no such zone", **flags)
        return claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    assert counted(is_error=True) > counted()  # the failure is said in the prompt


def _png_with_text(text: str) -> str:
    image = Image.new("RGB", (200, 48), "white")
    ImageDraw.Draw(image).text((10, 15), text, fill="black")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_an_image_block_is_read_and_counts_as_input(claude):
    question = {"type": "text", "text": "What does the picture say?"}
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": _png_with_text("HELLO 42")},
    }
    pictured = [{"role": "user", "content": [image, question]}]
    with_image = _message(claude, pictured, max_tokens=5)
    without = _message(claude, [{"role": "user", "content": [question]}], max_tokens=5)
    assert with_image.content and with_image.usage.output_tokens >= 1
    assert with_image.usage.input_tokens > without.usage.input_tokens
    counted = claude.messages.count_tokens(model=MODEL, messages=pictured)
    assert counted.input_tokens == with_image.usage.input_tokens


def test_count_tokens_is_the_input_a_message_reports_and_grows_with_tools(claude):
    def counted(**options) -> int:
        return claude.messages.count_tokens(
            model=MODEL, messages=CONVERSATION, **options
        ).input_tokens

    plain = counted(system=SYSTEM)
    assert plain == _message(claude, system=SYSTEM, max_tokens=1).usage.input_tokens
    tools = {"tools": [WEATHER, TIME], "tool_choice": ONE_TIME_CALL}
    with_tools = counted(system=SYSTEM, **tools)
    assert with_tools > plain + 40  # the tools are described in the prompt
    assert with_tools == _message(claude, system=SYSTEM, max_tokens=1, **tools).usage.input_tokens
    assert counted(system=SYSTEM, tools=[WEATHER, TIME], tool_choice={"type": "none"}) == plain


def test_output_config_format_gives_json_that_matches_the_schema(claude):
    schema = {
        "type": "object",
        "properties": {
            "colours": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "maxItems": 3,
            }
        },
        "required": ["colours"],
        "additionalProperties": False,
    }
    answer = _message(
        claude,
        CONVERSATION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        max_tokens=80,
    )
    assert answer.stop_reason == "end_turn"
    jsonschema.validate(json.loads(answer.content[0].text), schema)


def test_fields_claude_code_sends_are_accepted_and_change_nothing(claude):
    plain = _message(claude, system=SYSTEM)
    cached = {"type": "ephemeral"}
    dressed = _message(
        claude,
        [
            {
                **turn,
                "content": [{"type": "text", "text": turn["content"], "cache_control": cached}],
            }
            for turn in CONVERSATION
        ],
        system=[{"type": "text", "text": SYSTEM, "cache_control": cached}],
        metadata={"user_id": "someone"},
        service_tier="auto",
        extra_body={
            "thinking": {"type": "disabled"},
            "context_management": {"edits": []},
            "betas": ["interleaved-thinking-2025-05-14"],
        },
    )
    assert dressed.content[0].text == plain.content[0].text


BAD_REQUESTS = {
    "missing max_tokens": ({"max_tokens": anthropic.omit, "timeout": 30}, "max_tokens"),
    "an unknown field": ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    "a role other than user and assistant": (
        {"messages": [{"role": "tool", "content": "hello"}]},
        "messages.0.role",
    ),
    "an image by url": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "https://example.com/a.png"},
                        }
                    ],
                }
            ]
        },
        "offline",
    ),
    "a server tool": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "server tools",
    ),
    "an assistant turn last": (
        {"messages": [*CONVERSATION, {"role": "assistant", "content": "Cyan,"}]},
        "prefill",
    ),
}


@pytest.mark.parametrize("options, named", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_are_400s_in_anthropics_shape_naming_the_problem(claude, options, named):
    with pytest.raises(anthropic.BadRequestError) as raised:
        _message(claude, **options)
    error = raised.value
    assert error.status_code == 400 and error.body["type"] == "error"
    assert error.body["error"]["type"] == "invalid_request_error"
    assert named in error.body["error"]["message"]


def test_a_model_the_server_does_not_run_is_a_404_in_anthropics_shape(claude):
    for call in (
        lambda: claude.messages.create(
            model="claude-sonnet-4-5", messages=CONVERSATION, max_tokens=5
        ),
        lambda: claude.messages.count_tokens(model="claude-sonnet-4-5", messages=CONVERSATION),
    ):
        with pytest.raises(anthropic.NotFoundError) as raised:
            call()
        assert raised.value.body["error"]["type"] == "not_found_error"
        assert MODEL in raised.value.body["error"]["message"]  # says what it runs


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def test_the_models_list_answers_anthropics_client_in_its_shape(claude):
    listed = list(claude.models.list())
    assert listed[0].id == MODEL and listed[0].type == "model"
    assert listed[0].max_input_tokens == 1024 and listed[0].lifecycle == "active"


def test_a_client_that_leaves_a_stream_cancels_its_answer(base):
    cancelled = 'miniapp_requests_finished_total{finish_reason="cancelled"}'
    before = _metric(base, cancelled)
    body = {
        "model": MODEL,
        "max_tokens": 1000,  # the greedy essay runs to the limit: it is still being written
        **GREEDY,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a very long essay on rivers."}],
    }
    with httpx.stream("POST", base + "/v1/messages", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    deadline = time.monotonic() + 10
    while _metric(base, cancelled) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(base, cancelled) == before + 1
    generated = _metric(base, "miniapp_generation_tokens_total")
    time.sleep(0.5)
    assert _metric(base, "miniapp_generation_tokens_total") == generated
    assert _metric(base, "miniapp_requests_running") == 0


def test_a_wrong_key_is_an_authentication_error_and_x_api_key_opens(miniapp_exe):
    with running_server(miniapp_exe, "--api-key", KEY) as (_, url):
        wait_ready(url)
        wrong = anthropic.Anthropic(base_url=url, api_key="not-the-key", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as raised:
            wrong.messages.count_tokens(model=MODEL, messages=CONVERSATION)
        assert raised.value.status_code == 401
        assert raised.value.body["type"] == "error"
        assert raised.value.body["error"]["type"] == "authentication_error"
        right = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)  # sends x-api-key
        assert right.messages.count_tokens(model=MODEL, messages=CONVERSATION).input_tokens > 0
