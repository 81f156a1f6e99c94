"""The README's OpenAI SDK example runs as written against a real server (only the URL and key change)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from e2e_server import ROOT, BrineServer

pytestmark = pytest.mark.slow  # it starts the real server with the default model


def readme_sdk_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using it with the OpenAI SDK", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's SDK section has no python example"
    return match.group(1)


def test_readme_sdk_example_runs_and_hits_the_cache_the_second_time(brine_server: BrineServer) -> None:
    code = readme_sdk_example()
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and 'api_key="unused"' in code
    code = code.replace("http://127.0.0.1:8000/v1", f"{brine_server.base_url}/v1")
    code = code.replace('api_key="unused"', f'api_key="{brine_server.api_key}"')
    runs = []
    for _ in range(2):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})  # our own README, on purpose
        content, cached = out.getvalue().rstrip("\n").rsplit("\n", 1)
        runs.append((content, int(cached)))
    assert runs[0][0].strip(), "the example printed no answer"
    assert runs[1][0] == runs[0][0]  # temperature 0: the same answer, cache or not
    # The second run shares its whole prompt with the first (same salt); only the last block is recomputed.
    assert runs[1][1] > runs[0][1]
