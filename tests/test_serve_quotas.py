"""Per-key quotas (`--api-key-file`) on a real `miniapp serve`, through the official
`openai` client and raw HTTP: a key past its requests or tokens a minute, or its answers at
once, gets a 429 with Retry-After and `x-ratelimit-*` headers, and a retry at that time
succeeds; other keys are not held back; a bad key file is one line, exit 2."""

from __future__ import annotations

import subprocess
import time

import httpx
import openai
import pytest
from test_serve import MODEL, running_server, wait_ready

KEY_FILE = """
[keys.alice]
key = "alice-key"
requests_per_minute = 20

[keys.bob]
key = "bob-key"
tokens_per_minute = 600

[keys.carol]
key = "carol-key"
max_concurrent = 1
"""


@pytest.fixture(scope="module")
def keyed(miniapp_exe, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEY_FILE)
    with running_server(miniapp_exe, "--parallel", "2", "--api-key-file", str(path)) as (_, base):
        wait_ready(base)
        yield base


def ask(base: str, key: str, max_tokens: int = 1, **options) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    body |= {"max_tokens": max_tokens, "temperature": 0, **options}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_a_key_past_its_requests_a_minute_gets_429_and_a_retry_after_that_succeeds(keyed):
    answers = [ask(keyed, "alice-key") for _ in range(20)]
    assert [a.status_code for a in answers] == [200] * 20
    remaining = [int(a.headers["x-ratelimit-remaining-requests"]) for a in answers]
    assert (
        remaining[0] >= remaining[-1] and answers[0].headers["x-ratelimit-limit-requests"] == "20"
    )
    refused = ask(keyed, "alice-key")
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests_per_minute" in error["message"]
    wait = int(refused.headers["Retry-After"])
    assert 1 <= wait <= 3  # one request back every 3 s
    assert "x-ratelimit-reset-requests" in refused.headers
    assert ask(keyed, "bob-key").status_code == 200  # another key is not held back
    time.sleep(wait)
    assert ask(keyed, "alice-key").status_code == 200


def test_tokens_are_reserved_as_prompt_plus_max_tokens_and_unused_ones_come_back(keyed):
    client = openai.OpenAI(base_url=keyed + "/v1", api_key="bob-key", max_retries=0)
    with pytest.raises(openai.RateLimitError, match="more than key 'bob' may use"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=700
        )
    # 300 reserved each, a few used: the unused part returns, so many more fit in a minute.
    for _ in range(6):
        answer = ask(keyed, "bob-key", max_tokens=280)
        assert answer.status_code == 200, answer.text
        assert int(answer.headers["x-ratelimit-limit-tokens"]) == 600


def test_a_key_at_its_answers_at_once_gets_429_until_its_answer_ends(keyed):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}]}
    body |= {"max_tokens": 64, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer carol-key"}
    with httpx.stream("POST", keyed + "/v1/chat/completions", json=body, headers=headers) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # admitted, and answering
        second = ask(keyed, "carol-key")
        assert second.status_code == 429
        assert "max_concurrent" in second.json()["error"]["message"]
        assert int(second.headers["Retry-After"]) >= 1
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert ask(keyed, "carol-key").status_code == 200


def test_an_unknown_key_is_401_and_health_stays_open(keyed):
    assert ask(keyed, "mallory-key").status_code == 401
    assert httpx.get(keyed + "/health").status_code == 200


@pytest.mark.parametrize(
    "text, named",
    [
        ("[keys.a]\nrequests_per_minute = 5\n", "needs key"),
        ('[keys.a]\nkey = "k"\nrequests_per_minute = 0\n', "at least 1"),
        ('[keys.a]\nkey = "k"\nburst = 3\n', "unknown field 'burst'"),
        ('[keys.a]\nkey = "k"\n[keys.b]\nkey = "k"\n', "given twice"),
        ("keys = 3\n", "one [keys.NAME] table"),
        ("[keys.a\n", "not a TOML file"),
    ],
)
def test_a_bad_key_file_is_one_line_and_exit_2(miniapp_exe, tmp_path, text, named):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    done = subprocess.run(
        [miniapp_exe, "serve", "--port", "0", "--api-key-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
