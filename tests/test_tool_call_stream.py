"""Tool calls streamed while the model writes them (`app/serve/tools.py`: CallStream): fed an
answer in the documented format in pieces of any size, the parts it sends open each call
once its name is known and carry arguments that concatenate to the call's own JSON."""

from __future__ import annotations

import json

import pytest

from miniapp.app.serve.tools import CallStream, partial_calls

ANSWERS = [
    '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
    '[{"name":"a","arguments":{}},{"name":"b","arguments":{"x":[1,2,{"y":"]}"}]}}]',
    json.dumps([{"name": "quote", "arguments": {"text": 'he said "[hi]" \\ {ok}'}}], indent=2),
    '[{"arguments": {"zone": "UTC"}, "name": "get_time"}]',  # arguments before the name
    '[ {"name": "f", "arguments": "{\\"n\\": 1}"} ]',  # arguments as a JSON string
]


def _replay(answer: str, piece: int) -> tuple[dict[int, dict], list[int]]:
    stream, calls, opened_at = CallStream(), {}, []
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
def test_streamed_calls_reassemble_to_the_answer(answer, piece):
    calls, _ = _replay(answer, piece)
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
