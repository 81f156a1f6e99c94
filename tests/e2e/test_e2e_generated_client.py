"""A client generated from the live server's `/openapi.json` (openapi-python-client, from PyPI) sends a salted
chat request: the salt is a typed field of the generated model, it reaches the engine (the second request
under the same salt hits the cache, another salt does not), and an invalid salt comes back as the published
OpenAI error object. Generation takes about a second; the requests reuse the session's server."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from e2e_server import BrineServer

pytestmark = pytest.mark.slow
PACKAGE = "brine_generated_client"


def _generator() -> list[str]:
    exe = Path(sys.executable).parent / "openapi-python-client"
    if not exe.exists():
        pytest.fail("openapi-python-client is missing: it is a test dependency")
    return [str(exe)]


@pytest.fixture(scope="module")
def generated(brine_server: BrineServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    work = tmp_path_factory.mktemp("generated-client")
    r = httpx.get(f"{brine_server.base_url}/openapi.json", headers=brine_server.headers, timeout=30)
    assert r.status_code == 200, r.text
    (work / "openapi.json").write_text(r.text)
    (work / "config.yaml").write_text(json.dumps({"post_hooks": [], "package_name_override": PACKAGE}))
    result = subprocess.run(
        [*_generator(), "generate", "--path", "openapi.json", "--meta", "none", "--config", "config.yaml"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (work / PACKAGE / "client.py").exists(), result.stdout + result.stderr
    sys.path.insert(0, str(work))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(work))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def test_generated_client_sends_a_salted_chat_request(
    generated: ModuleType, brine_server: BrineServer
) -> None:
    chat = importlib.import_module(f"{PACKAGE}.api.default.create_chat_completion")
    models = importlib.import_module(f"{PACKAGE}.models")
    client = generated.AuthenticatedClient(
        base_url=brine_server.base_url, token=brine_server.api_key, timeout=httpx.Timeout(300)
    )
    document = " ".join(f"clause {i} of the shared contract says nothing new." for i in range(40))

    def ask(salt: str) -> dict:
        body = models.ChatCompletionRequest(
            messages=[
                models.ChatMessage(role=models.ChatMessageRole.SYSTEM, content=document),
                models.ChatMessage(role=models.ChatMessageRole.USER, content="Summarise."),
            ],
            max_tokens=2,
            temperature=0,
            cache_salt=salt,
        )
        r = chat.sync_detailed(client=client, body=body)
        assert r.status_code == 200, r.content
        assert r.parsed["object"] == "chat.completion"
        return r.parsed["usage"]

    salt = f"tenant-{uuid.uuid4().hex}"
    assert ask(salt)["prompt_tokens_details"]["cached_tokens"] == 0
    assert ask(salt)["prompt_tokens_details"]["cached_tokens"] > 0
    assert ask(salt + "-other")["prompt_tokens_details"]["cached_tokens"] == 0

    bad = models.ChatCompletionRequest(
        messages=[models.ChatMessage(role=models.ChatMessageRole.USER, content="hi")], cache_salt=""
    )
    r = chat.sync_detailed(client=client, body=bad)
    assert r.status_code == 400
    assert isinstance(r.parsed, models.ErrorResponse)
    assert r.parsed.error.param == "cache_salt" and r.parsed.error.code == "invalid_cache_salt"
