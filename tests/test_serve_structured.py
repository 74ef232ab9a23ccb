"""Structured output and tool calls through `miniapp serve`, with the official `openai`
package: `response_format` (a JSON object, a JSON schema), `tools` with `tool_choice`
required / a named function / none / auto, streamed tool-call deltas, and a tool's result
going back into the chat. Answers are checked with the `jsonschema` package.

Tool calls are tested in both formats (app/serve/tools.py): the documented one, which the
bundled model's template gets, and the model's own, through a template of Hermes' kind
(it takes `tools` and writes <tool_call> tags) given with `--chat-template-file`."""

from __future__ import annotations

import json
import re
import subprocess

import jsonschema
import openai
import pytest
from test_serve import MODEL, running_server, wait_ready
from tool_schemas import TIME_ARGUMENTS, TIME_TEXT, WEATHER_ARGUMENTS, WEATHER_TEXT

PLACE = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": WEATHER_TEXT,
        "parameters": WEATHER_ARGUMENTS,
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": TIME_TEXT, "parameters": TIME_ARGUMENTS},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base(miniapp_exe):
    # --spec auto: the greedy answers below must be what plain decoding gives.
    with running_server(miniapp_exe, "--parallel", "2", "--spec", "auto") as (_, url):
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


# A template of Hermes' kind, written for these tests on SmolLM2's ChatML turns: the tools in
# the system turn, calls in <tool_call> tags, results in <tool_response> tags.
TAGGING_TEMPLATE = """\
{% if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call, one per <tool_call></tool_call> tag, written as
{"name": <name>, "arguments": <object>}:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for message in messages if message.role != 'system' %}
{% if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tagging_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "hermes_kind.jinja"
    path.write_text(TAGGING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tagging_client(miniapp_exe, tagging_template) -> openai.OpenAI:
    flags = ("--spec", "auto", "--chat-template-file", str(tagging_template))
    with running_server(miniapp_exe, *flags) as (_, url):
        wait_ready(url)
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(params=["documented", "own"], ids=["documented-format", "models-own-format"])
def tool_client(request) -> openai.OpenAI:
    """A server whose model gets the documented tool format, or its template's own."""
    return request.getfixturevalue("client" if request.param == "documented" else "tagging_client")


def _ask(client, messages, **options):
    options = {"temperature": 0, "max_tokens": 160, **options}
    return client.chat.completions.create(model=MODEL, messages=messages, **options)


def _parameters(tool: dict) -> dict:
    return tool["function"]["parameters"]


def test_a_json_schema_response_format_validates_on_chat_and_completions(client):
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": PLACE, "strict": True},
    }
    asked = [{"role": "user", "content": "Tell me about Paris as JSON."}]
    answer = _ask(client, asked, response_format=schema_format)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PLACE)
    streamed = _ask(client, asked, response_format=schema_format, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == answer.choices[0].message.content
    prompt = "<|im_start|>user\nTell me about Rome as JSON.<|im_end|>\n<|im_start|>assistant\n"
    completion = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=160,
        extra_body={"response_format": schema_format},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), PLACE)
    fruit = "Return a JSON object with the name and colour of a fruit."
    anything = _ask(
        client, [{"role": "user", "content": fruit}], response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("response_format", "named"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}},
            "strng",
        ),
        ({"type": "json_schema"}, "json_schema is required"),
    ],
)
def test_an_invalid_schema_is_a_400_naming_the_problem(client, response_format, named):
    with pytest.raises(openai.BadRequestError) as raised:
        _ask(client, ASK_WEATHER, response_format=response_format)
    error = raised.value.body
    assert raised.value.status_code == 400 and named in error["message"]
    assert error["param"] == "response_format"


def test_tool_choice_required_gives_one_valid_call_and_none_gives_none(tool_client):
    answer = _ask(
        tool_client,
        ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), _parameters(tool))
    plain = _ask(tool_client, ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_a_named_function_is_the_one_called_and_streamed_deltas_reassemble(tool_client):
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = _ask(tool_client, ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=named)
    calls = whole.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), _parameters(TIME))
    streamed = _ask(tool_client, ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=named, stream=True)
    parts: dict[int, dict] = {}
    reasons = []
    for chunk in streamed:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                part = parts.setdefault(delta.index, {"name": "", "arguments": "", "pieces": 0})
                part["id"] = delta.id or part.get("id")
                if delta.function.name:
                    part["name"] += delta.function.name
                part["arguments"] += delta.function.arguments or ""
                part["pieces"] += bool(delta.function.arguments)
    assert reasons[-1] == "tool_calls"
    # The arguments arrive as the model writes them, not in one piece at the end.
    assert all(part["pieces"] > 1 for part in parts.values())
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]


def test_a_tool_result_goes_back_into_the_chat(tool_client):
    first = _ask(tool_client, ASK_WEATHER, tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    called = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    asked_and_called = [*ASK_WEATHER, called]

    def answer_given(result: dict):
        tool_message = {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
        return _ask(
            tool_client,
            [*asked_and_called, tool_message],
            tools=[WEATHER],
            tool_choice="none",
            max_tokens=40,
        )

    sunny = answer_given({"temperature": 18, "sky": "sunny", "wind_kmh": 5})
    stormy = answer_given({"temperature": -7, "sky": "snow storm", "wind_kmh": 90})
    for reply in (sunny, stormy):
        assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    # What a 135M model makes of a result varies with the CPU's rounding, so rather than
    # looking for words, check that the result reached the prompt and steered the answer.
    empty = answer_given({})
    assert sunny.usage.prompt_tokens >= empty.usage.prompt_tokens + 8
    assert sunny.choices[0].message.content != stormy.choices[0].message.content


def test_auto_answers_in_text_or_a_valid_call(tool_client):
    for question in ("What is the weather in Paris? Use the tool.", "Say hello."):
        answer = _ask(
            tool_client,
            [{"role": "user", "content": question}],
            tools=[WEATHER],
            tool_choice="auto",
        )
        message = answer.choices[0].message
        if message.tool_calls:
            assert answer.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), _parameters(WEATHER))
        else:
            assert message.content and message.content.lstrip()[:1] not in ("[", "<")


def test_bad_tool_requests_are_400s(client):
    unknown = {"type": "function", "function": {"name": "nope"}}
    for options, param in [
        ({"tools": [WEATHER], "tool_choice": unknown}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ]:
        with pytest.raises(openai.BadRequestError) as raised:
            _ask(client, ASK_WEATHER, **options)
        assert raised.value.body["param"] == param, raised.value.body


def test_other_servers_constraint_fields_work_and_two_at_once_are_refused(client):
    """llama-server's GBNF `grammar`, vLLM's `guided_regex` and `guided_choice`."""
    asked = [{"role": "user", "content": "Is the sky blue?"}]
    gbnf = 'root ::= ("yes" | "no") " because " [a-z ]{1,40}'
    answer = _ask(client, asked, extra_body={"grammar": gbnf}).choices[0].message.content
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,40}", answer), answer
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    answer = _ask(client, asked, extra_body={"guided_regex": pattern}).choices[0].message.content
    assert re.fullmatch(pattern, answer), answer
    answer = _ask(client, asked, extra_body={"guided_choice": ["yes", "no"]})
    assert answer.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as raised:
        _ask(client, asked, extra_body={"guided_regex": "a+", "guided_choice": ["a"]})
    assert "only one constraint" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        _ask(client, asked, extra_body={"grammar": "root ::= missing"})
    assert raised.value.body["param"] == "grammar"


def test_the_models_own_template_renders_the_tools_and_the_tool_traffic(
    tagging_client, default_model
):
    """With a template that takes tools, the prompt is the template's own rendering: the
    tools as it describes them, an earlier call in its tags, a result in its tags."""
    from miniapp.engine.modelfile.template import ChatTemplate, Message
    from miniapp.engine.tokens.tokenizer import Tokenizer

    tokenizer, template = Tokenizer(default_model), ChatTemplate(TAGGING_TEMPLATE)

    def tokens(messages, tools=None) -> int:
        return len(tokenizer.encode_chat(template.render(messages, tools=tools)))

    asked = [Message("user", ASK_WEATHER[0]["content"])]
    first = _ask(tagging_client, ASK_WEATHER, tools=[WEATHER], tool_choice="required")
    assert first.usage.prompt_tokens == tokens(asked, [WEATHER])
    call = first.choices[0].message.tool_calls[0]
    result = json.dumps({"temperature": 18, "sky": "sunny"})
    called = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    reply = _ask(
        tagging_client,
        [*ASK_WEATHER, called, {"role": "tool", "tool_call_id": call.id, "content": result}],
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=8,
    )
    arguments = json.loads(call.function.arguments)
    traffic = [
        Message(
            "assistant",
            "",
            tool_calls=(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                },
            ),
        ),
        Message("tool", result, tool_call_id=call.id),
    ]
    rendered = template.render([*asked, *traffic])
    assert "<tool_response>" in rendered and '"arguments": {' in rendered
    assert reply.usage.prompt_tokens == tokens([*asked, *traffic])


@pytest.mark.parametrize(("text", "says"), [(None, "cannot read"), ("{% if %}", "does not parse")])
def test_a_bad_chat_template_file_is_one_line_and_exit_2(miniapp_exe, tmp_path, text, says):
    path = tmp_path / "template.jinja"
    if text is not None:
        path.write_text(text)
    done = subprocess.run(
        [miniapp_exe, "serve", "--port", "0", "--chat-template-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert says in line and "\n" not in line
