from __future__ import annotations

import json

import pytest

from miniapp.engine.chat.generation import StopMatcher
from miniapp.engine.modelfile.template import CHATML_TEMPLATE, ChatTemplate, Message, TemplateError


def _feed(stops, pieces):
    matcher = StopMatcher(stops)
    shown, hit = [], False
    for piece in pieces:
        text, hit = matcher.push(piece)
        shown.append(text)
        if hit:
            break
    if not hit:
        shown.append(matcher.flush())
    return "".join(shown), hit


def test_stop_string_split_across_pieces_is_cut_and_hidden():
    assert _feed(["</end>"], ["hello </", "en", "d> ignored"]) == ("hello ", True)


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    assert _feed(["STOP"], ["a ST", "ART b"]) == ("a START b", False)


def test_no_stops_passes_text_through():
    assert _feed([], ["a", "b"]) == ("ab", False)


def test_chatml_fallback_renders_generation_prompt():
    template = ChatTemplate(None)
    assert template.is_fallback and template.source == CHATML_TEMPLATE
    text = template.render([Message("user", "hi")])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_sandbox_blocks_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        template.render([Message("user", "x")])


def test_template_raise_exception_becomes_template_error():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="roles must alternate"):
        template.render([Message("user", "x")])


def test_gemma_fallback_template_for_files_without_one():
    template = ChatTemplate(None, "<bos>", "<eos>", architecture="gemma3")
    text = template.render(
        [Message("system", "Be brief."), Message("user", "hi"), Message("assistant", "Hello!")]
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>model\n"
    )


def test_a_template_says_whether_it_takes_tools_and_writes_tool_call_tags(default_model):
    from miniapp.engine.modelfile.gguf_file import GGUFFile

    bundled = ChatTemplate(GGUFFile(default_model).metadata.get("tokenizer.chat_template"))
    assert not bundled.takes_tools and not bundled.tags_tool_calls
    listing = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    lists = ChatTemplate(listing)
    assert lists.takes_tools and not lists.tags_tool_calls
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert lists.render([Message("user", "hi")], tools=[tool]) == "f;hi"
    assert lists.render([Message("user", "hi")]) == "hi"  # no tools: the variable is unset
    tags = ChatTemplate("{% if tools %}<tool_call>{% endif %}" + listing)
    assert tags.takes_tools and tags.tags_tool_calls
    # A tool's traffic reaches the template in OpenAI's shape.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    shown = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ (m.tool_calls or []) | tojson }}"
        "{{ m.tool_call_id }}|{% endfor %}"
    )
    text = shown.render(
        [Message("assistant", "", tool_calls=(call,)), Message("tool", "42", tool_call_id="c1")]
    )
    assert text == f"assistant:{json.dumps([call])}|tool:[]c1|"
