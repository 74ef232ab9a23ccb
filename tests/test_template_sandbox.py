"""Chat templates are code from downloaded files: escapes out of the sandbox are refused,
and a render that runs too long or builds too much is stopped with one line."""

from __future__ import annotations

import time

import pytest

from miniapp.engine.modelfile.template import (
    MAX_RENDERED_CHARS,
    RENDER_SECONDS,
    ChatTemplate,
    Message,
    TemplateError,
)

HELLO = [Message("user", "hello")]


def _refusal(source: str) -> str:
    """The one-line error a render of `source` ends in, and that it ends in time."""
    start = time.monotonic()
    with pytest.raises(TemplateError) as caught:
        ChatTemplate(source).render(HELLO)
    assert time.monotonic() - start < RENDER_SECONDS + 3
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "escape",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ self._TemplateReference__context }}",
        "{% set x = messages.append(1) %}{{ x }}",
        "{{ strftime_now.__globals__['datetime'] }}",
    ],
)
def test_escapes_out_of_the_sandbox_are_refused(escape):
    message = _refusal(escape)
    assert message.startswith("the model's chat template failed:"), message
    assert "is not allowed in a template" in message or "not safely callable" in message


@pytest.mark.parametrize(
    "source, cause",
    [
        # Loops that build nothing: stopped by the clock.
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "ran longer than",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0] and '' }}"
            "{% endfor %}{% endfor %}",
            "ran longer than",
        ),
        # Output or values too large: refused before they are built.
        ("{{ 'x' * 1000000000 }}", "built more than"),
        ("{% set a = ['x'] * 1000000000 %}{{ a | length }}", "built more than"),
        ("{{ 10 ** 100000000 }}", "to the power"),
        ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "built more than"),
    ],
)
def test_a_render_that_runs_too_long_or_builds_too_much_is_stopped(source, cause):
    message = _refusal(source)
    assert message.startswith("the model's chat template was stopped:"), message
    assert cause in message


def test_ordinary_templates_render_within_the_budget():
    template = ChatTemplate(None)  # ChatML
    long_chat = [Message("user" if i % 2 == 0 else "assistant", "word " * 2000) for i in range(200)]
    text = template.render(long_chat)
    assert len(text) > 2_000_000 and len(text) < MAX_RENDERED_CHARS
    assert template.render(HELLO).endswith("<|im_start|>assistant\n")
