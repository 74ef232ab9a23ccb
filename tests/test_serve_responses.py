"""OpenAI's Responses API on `miniapp serve` (app/serve/responses.py), through the official
`openai` package's responses client and raw HTTP (httpx), against a real server process
answering with the bundled SmolLM2: the answers are the chat endpoint's for the same
conversation, plain and streamed, with function calls, stored responses and
previous_response_id, and requests we cannot answer refused by name."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from test_serve import MODEL, running_server, wait_ready
from tool_schemas import TIME_ARGUMENTS, TIME_TEXT, WEATHER_ARGUMENTS, WEATHER_TEXT

from miniapp.app.serve.errors import ApiError
from miniapp.app.serve.responses import ResponseStore, StoredResponse

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": WEATHER_TEXT,
    "parameters": WEATHER_ARGUMENTS,
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": TIME_TEXT,
    "parameters": TIME_ARGUMENTS,
}
PLACE = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
SYSTEM = "You are a helpful assistant who answers briefly."
QUESTION = "Say hello in French."  # answered greedily in 56 tokens
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",  # one or more
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
GREEDY = {"temperature": 0, "max_output_tokens": 64}


@pytest.fixture(scope="module")
def base(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "2") as (_, url):
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def chat_answer(client, messages: list[dict], max_tokens: int = 64) -> str:
    """What the chat endpoint answers, greedily, to the same conversation."""
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
    )
    return answer.choices[0].message.content


def sse_events(raw: str) -> list[tuple[str, dict]]:
    """A Responses stream's (event name, data) pairs."""
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def collapsed(kinds: list[str]) -> list[str]:
    """Event types with repeats (the deltas) shown once."""
    return [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]


# ------------------------------------------------------------------ answers


def test_a_greedy_response_is_the_chat_answer_plain_and_streamed(client):
    expected = chat_answer(
        client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    )
    plain = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, **GREEDY)
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert plain.output_text == expected
    assert plain.status == "completed" and plain.incomplete_details is None
    (message,) = plain.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert plain.instructions == SYSTEM and plain.max_output_tokens == 64
    usage = plain.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    deltas = []
    with client.responses.stream(
        model=MODEL, instructions=SYSTEM, input=QUESTION, **GREEDY
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        streamed = stream.get_final_response()
    assert "".join(deltas) == expected == streamed.output_text
    assert streamed.status == plain.status and streamed.usage == plain.usage


def test_the_raw_event_stream_names_each_event_and_numbers_them_in_order(base):
    # With the instructions the greedy answer ends before max_output_tokens on the CPU
    # families seen (without them, an AVX2-only EPYC's, and llama.cpp's there, loops on).
    body = {"model": MODEL, "instructions": SYSTEM, "input": QUESTION, "stream": True, **GREEDY}
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.read().decode())
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert collapsed([name for name, _ in events]) == TEXT_EVENTS
    data = [d for _, d in events]
    message_id = data[2]["item"]["id"]
    assert all(d["item_id"] == message_id for d in data[3:-2])
    deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    done = data[-1]["response"]
    assert deltas == done["output"][0]["content"][0]["text"] == data[-4]["text"]
    assert data[0]["response"]["status"] == "in_progress" and done["status"] == "completed"


def test_max_output_tokens_makes_the_response_incomplete_plain_and_streamed(client):
    short = {"model": MODEL, "input": "Write a long story about rivers.", "max_output_tokens": 4}
    plain = client.responses.create(**short)
    assert plain.status == "incomplete"
    assert plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == 4 and plain.output[0].status == "incomplete"
    with client.responses.create(**short, stream=True) as events:
        last = list(events)[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].content[0].text == last.response.output_text


def test_a_json_schema_text_format_gives_json_that_validates(client):
    text = {"format": {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}}
    answer = client.responses.create(
        model=MODEL,
        input="Tell me about Paris as JSON.",
        text=text,
        temperature=0,
        max_output_tokens=80,
    )
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), PLACE)
    assert answer.text.format.type == "json_schema"


# ------------------------------------------------------------------ function calls


def test_a_named_function_gives_a_call_whose_arguments_fit_its_schema_plain_and_streamed(
    client,
):
    asked = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 80,
    }
    plain = client.responses.create(**asked)
    assert plain.status == "completed"
    (call,) = plain.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_ARGUMENTS)
    assert plain.output_text == ""

    kinds, pieces = [], []
    with client.responses.stream(**asked) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
            elif event.type == "response.function_call_arguments.done":
                joined = event.arguments
        (streamed,) = stream.get_final_response().output
    assert collapsed(kinds) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(pieces) == joined == streamed.arguments
    assert streamed.type == "function_call" and streamed.name == "get_weather"
    assert json.loads(joined) == json.loads(call.arguments)


def test_a_function_output_continues_the_conversation_as_chat_completions_would(client):
    question = "What is the weather in Paris?"
    first = client.responses.create(
        model=MODEL,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=80,
    )
    (call,) = first.output
    result = "Sunny and 21 degrees celsius."
    follow_up = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        **GREEDY,
    )
    assert [item.type for item in follow_up.output] == ["message"]
    assert follow_up.previous_response_id == first.id
    called = {"name": call.name, "arguments": call.arguments}
    expected = chat_answer(
        client,
        [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "tool_calls": [{"id": call.call_id, "type": "function", "function": called}],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
    )
    assert follow_up.output_text == expected


# ------------------------------------------------------------------ stored responses


def test_previous_response_id_continues_the_conversation_as_chat_completions_would(client):
    first_question, second_question = "Name three colours.", "Which of them is the warmest?"
    first = client.responses.create(
        model=MODEL, instructions=SYSTEM, input=first_question, **GREEDY
    )
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=second_question, **GREEDY
    )
    # As OpenAI documents, the first response's instructions are not carried over.
    expected = chat_answer(
        client,
        [
            {"role": "user", "content": first_question},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": second_question},
        ],
    )
    assert second.output_text == expected
    # The same conversation given whole, as a client that stores nothing sends it.
    replayed = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": first_question},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": second_question}],
            },
        ],
        store=False,
        **GREEDY,
    )
    assert replayed.output_text == expected


def test_stored_responses_are_retrieved_and_deleted_and_unstored_ones_are_not_kept(client, base):
    kept = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, metadata={"topic": "greeting"}
    )
    found = client.responses.retrieve(kept.id)
    assert found.id == kept.id and found.output_text == kept.output_text
    assert found.metadata == {"topic": "greeting"} and found.store is True
    deleted = httpx.delete(f"{base}/v1/responses/{kept.id}")
    assert deleted.json() == {"id": kept.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)

    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(
            model=MODEL, input="And then?", previous_response_id=unstored.id, max_output_tokens=4
        )
    assert raised.value.body["param"] == "previous_response_id"


def test_an_unknown_previous_response_id_is_a_404_naming_the_field(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nothing")
    error = raised.value.response.json()["error"]
    assert error["param"] == "previous_response_id" and "resp_nothing" in error["message"]
    assert error["type"] == "invalid_request_error"


def _stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id}, ())


def test_the_store_forgets_the_least_recently_used_response_past_its_bound():
    store = ResponseStore(bound=3)
    for name in ("a", "b", "c"):
        store.put(_stored(name))
    assert store.get("a") is not None  # used: "b" is now the least recently used
    store.put(_stored("d"))
    assert store.get("b") is None and len(store) == 3
    assert all(store.get(name) is not None for name in ("a", "c", "d"))
    assert store.delete("c") and not store.delete("c")
    with pytest.raises(ApiError) as raised:
        store.found("b", "previous_response_id")
    assert raised.value.status == 404 and raised.value.param == "previous_response_id"


# ------------------------------------------------------------------ refusals


def _with_image(image: dict, role: str = "user") -> dict:
    return {"role": role, "content": [{"type": "input_image", **image}]}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"bogus": 1}, "bogus"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.1.type"),
        ({"input": 42}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.message.role"),
        # Items and tools that are no objects: once a 500 (found by tests/fuzz_api.py).
        ({"input": [0]}, "input.0"),
        ({"input": ["Hi", None]}, "input.0"),
        ({"tools": [False]}, "tools.0"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [_with_image({"image_url": "http://example.com/a.png"})]}, "input"),
        ({"input": [_with_image({"file_id": "file-1"})]}, "input.0.content"),
        ({"input": [_with_image({"image_url": "data:,"}, role="system")]}, "input.0.content"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}},
            "text.format",
        ),
    ],
)
def test_bad_requests_are_400s_in_openais_shape_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        # extra_body: sent as given, past the SDK's own typing
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, extra_body=extra)
    error = raised.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_a_client_that_leaves_a_stream_cancels_its_answer(base):
    body = {
        "model": MODEL,
        "input": "Write a very long essay on rivers.",  # 900 tokens, uncancelled
        "max_output_tokens": 900,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base + "/v1/responses", json=body) as response:
            # One iterator throughout: one dropped half-way would close the connection.
            lines = response.iter_lines()
            assert "event: response.output_text.delta" in lines
            assert _running(base) == 1
        left = time.monotonic()
        while _running(base) and time.monotonic() - left < 3:
            time.sleep(0.05)
    assert _running(base) == 0, "the answer kept generating after its client left"


def _running(base: str) -> int:
    """Answers the server is generating now (its /metrics gauge)."""
    metrics = httpx.get(base + "/metrics").text
    return int(float(re.search(r"^miniapp_requests_running (\S+)$", metrics, re.M).group(1)))
