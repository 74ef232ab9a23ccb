"""The model host's models on demand (the server's --max-models and --idle-unload), on real
tiny GGUFs opened by the torch engine: one load however many ask, the least recently used
idle model out first, a model that answers never let go, and what would not fit refused
with the reason."""

from __future__ import annotations

import threading
import time

import pytest
from tiny_gguf import LLAMA, QWEN3, write_tiny_model

from miniapp.app.host.model_host import LoadState, ModelHost, ModelLoadError, ModelLoading
from miniapp.engine.api import RuntimeConfig

WAIT_S = 60.0


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    made = {}
    for name, spec, seed in (("a", LLAMA, 1), ("b", QWEN3, 2), ("c", LLAMA, 3)):
        path = write_tiny_model(folder / f"{name}.gguf", spec, seed=seed)
        made[name] = RuntimeConfig(str(path), ctx=128, spec="off", parallel=2)
    broken = folder / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    made["broken"] = RuntimeConfig(str(broken), ctx=128)
    return made


def leased(host: ModelHost, spec: RuntimeConfig):
    """The runtime, once its load (started by the first ask) is done; leased."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return host.acquire(spec)
        except ModelLoading:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def use(host: ModelHost, spec: RuntimeConfig) -> None:
    host.release(leased(host, spec))


def resident(host: ModelHost) -> set[str]:
    return {
        spec.label.removesuffix(".gguf")
        for spec, state in host.resident_specs().items()
        if state is LoadState.READY
    }


def test_a_model_asked_for_by_eight_at_once_loads_once(specs):
    host = ModelHost(max_models=2)
    answers: list = []

    def ask():
        try:
            host.acquire(specs["a"])
        except ModelLoading as exc:
            answers.append(exc.retry_after)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 8 and all(seconds >= 1 for seconds in answers)
    runtime = leased(host, specs["a"])
    assert host.loads == {"a.gguf": 1}
    assert runtime is leased(host, specs["a"])  # the same model, not a second copy


def test_past_max_models_the_least_recently_used_idle_model_goes(specs):
    host = ModelHost(max_models=2)
    use(host, specs["a"])
    use(host, specs["b"])
    use(host, specs["a"])  # b is now the least recently used
    use(host, specs["c"])
    assert resident(host) == {"a", "c"}
    assert host.loads == {"a.gguf": 1, "b.gguf": 1, "c.gguf": 1}


def test_a_model_that_answers_is_never_let_go(specs):
    host = ModelHost(max_models=1)
    answering = leased(host, specs["a"])
    with pytest.raises(ModelLoading, match="would not fit beside the models answering now"):
        host.acquire(specs["b"])
    assert resident(host) == {"a"}
    host.release(answering)
    use(host, specs["b"])
    assert resident(host) == {"b"}


def test_a_model_that_would_not_fit_in_memory_is_refused_with_the_reason(specs):
    host = ModelHost(max_models=4, memory=lambda: 1024)
    with pytest.raises(ModelLoading, match="would not fit in memory"):
        host.acquire(specs["a"])
    assert host.loads == {} and resident(host) == set()


def test_idle_models_are_unloaded_and_load_again_when_asked_for(specs):
    host = ModelHost(max_models=2, idle_unload_s=0.5)
    use(host, specs["a"])
    answering = leased(host, specs["b"])
    deadline = time.monotonic() + WAIT_S
    while "a" in resident(host):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)
    assert resident(host) == {"b"}  # leased: kept however long it answers
    host.release(answering)
    use(host, specs["a"])
    assert host.loads["a.gguf"] == 2


def test_a_failed_load_is_said_once_then_tried_again(specs):
    host = ModelHost(max_models=2)
    with pytest.raises(ModelLoading):
        host.acquire(specs["broken"])
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            host.acquire(specs["broken"])
        except ModelLoadError as exc:
            assert "broken.gguf failed to load" in str(exc)
            break
        except ModelLoading:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with pytest.raises(ModelLoading):  # asked again: a new try
        host.acquire(specs["broken"])


def test_the_interfaces_model_and_a_request_for_it_share_one_load(specs):
    host = ModelHost(max_models=2)
    host.request(specs["a"])  # the GUI's picker, the terminal's /model
    try:
        host.acquire(specs["a"])
    except ModelLoading:
        pass
    runtime = host.wait_for(specs["a"], WAIT_S)
    assert host.runtime is runtime and host.status.state is LoadState.READY
    assert leased(host, specs["a"]) is runtime
    assert host.loads == {"a.gguf": 1}
