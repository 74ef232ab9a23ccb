"""Tool calls streamed while the model writes them (`app/serve/tools.py`: CallStream): fed an
answer in pieces of any size, in the documented format or in <tool_call> tags, the parts it
sends open each call once its name is known and carry arguments that concatenate to the
call's own JSON."""

from __future__ import annotations

import json

import pytest

from miniapp.app.serve.tools import CallStream, ToolPlan, partial_calls

ANSWERS = [
    '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
    '[{"name":"a","arguments":{}},{"name":"b","arguments":{"x":[1,2,{"y":"]}"}]}}]',
    json.dumps([{"name": "quote", "arguments": {"text": 'he said "[hi]" \\ {ok}'}}], indent=2),
    '[{"arguments": {"zone": "UTC"}, "name": "get_time"}]',  # arguments before the name
    '[ {"name": "f", "arguments": "{\\"n\\": 1}"} ]',  # arguments as a JSON string
]


def _tagged(answer: str) -> str:
    """The same calls in <tool_call> tags, a line apart."""
    return "\n".join(
        f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in json.loads(answer)
    )


def _replay(answer: str, piece: int, tagged=False) -> tuple[dict[int, dict], list[int]]:
    stream, calls, opened_at = CallStream(tagged), {}, []
    for start in range(0, len(answer), piece):
        for part in stream.feed(answer[start : start + piece]):
            call = calls.setdefault(part["index"], {"arguments": ""})
            if "id" in part:
                assert part["type"] == "function" and part["function"]["arguments"] == ""
                call.update(id=part["id"], name=part["function"]["name"])
                opened_at.append(start)
            else:
                assert "id" in call, "arguments came before their call opened"
                call["arguments"] += part["function"]["arguments"]
    return calls, opened_at


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize("tagged", [False, True], ids=["array", "tags"])
def test_streamed_calls_reassemble_to_the_answer(answer, piece, tagged):
    calls, _ = _replay(_tagged(answer) if tagged else answer, piece, tagged)
    want = json.loads(answer)
    assert [calls[k]["name"] for k in sorted(calls)] == [c["name"] for c in want]
    for k, call in enumerate(want):
        assert json.loads(calls[k]["arguments"]) == call["arguments"]
    assert len({call["id"] for call in calls.values()}) == len(calls)


def test_a_call_opens_before_its_arguments_are_written():
    answer = ANSWERS[0]
    calls, opened_at = _replay(answer, 1)
    assert opened_at == [answer.index('",')]  # with the name's closing quote
    pieces = []
    stream = CallStream()
    for char in answer:
        pieces += [p for p in stream.feed(char) if "id" not in p]
    assert len(pieces) == len(calls[0]["arguments"])  # a piece for each character written


def test_an_unfinished_answer_gives_what_is_known():
    calls = partial_calls('[{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]
    assert partial_calls('[{"name": "get_wea')[0].name is None


@pytest.mark.parametrize("tagged", [False, True], ids=["array", "tags"])
def test_a_whole_answer_gives_its_calls_and_an_unfinished_one_none(tagged):
    plan = ToolPlan(functions=(), choice="auto", parallel=True, tagged=tagged)
    for answer in ANSWERS:
        text = _tagged(answer) if tagged else answer
        calls = plan.calls_in(text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            (c["name"], c["arguments"]) for c in json.loads(answer)
        ]
        assert plan.calls_in(text[:-3]) is None  # cut off by max_tokens: shown as text
    assert plan.calls_in("Hello [world]") is None and plan.calls_in("I <3 you") is None
