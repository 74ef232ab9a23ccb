"""Every input the GGUF fuzzer (tests/fuzz_gguf.py) found crashing, hanging or leaking is
kept in tests/data/gguf_crashers/, named for what it broke: each must now be refused in one
line, by name, as a bad file."""

from __future__ import annotations

from pathlib import Path

import pytest
from first_token import load_to_first_token

from miniapp.engine.errors import ModelFileError

CRASHERS = sorted((Path(__file__).parent / "data" / "gguf_crashers").glob("*.gguf"))


def test_the_crashers_are_kept():
    assert CRASHERS, "tests/data/gguf_crashers/ is empty"


@pytest.mark.parametrize("path", CRASHERS, ids=lambda path: path.stem)
def test_a_fuzzer_finding_is_refused_in_one_line(path):
    with pytest.raises(ModelFileError) as refused:
        load_to_first_token(path)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)
