"""cache_salt through the SDK's extra_body: validation, and prefix-cache isolation between salts."""

from __future__ import annotations

import random
import uuid

import openai
import pytest
from e2e_server import BrineServer

pytestmark = pytest.mark.slow

WORDS = "river stone garden lamp orbit copper violet engine harbor meadow signal canvas lantern prism".split()


def _document(words: int = 150) -> str:
    rng = random.Random(uuid.uuid4().int)  # a prefix no earlier test can have cached
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _cached(client: openai.OpenAI, model: str, prompt: str, salt: str | None) -> tuple[int, int]:
    extra = {} if salt is None else {"cache_salt": salt}
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def test_salt_is_accepted_on_both_routes(client: openai.OpenAI, brine_server: BrineServer) -> None:
    salt = "tenant-" + "x" * 1017  # exactly 1024 characters
    chat = client.chat.completions.create(
        model=brine_server.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"cache_salt": salt},
    )
    assert chat.choices[0].message.content is not None
    completion = client.completions.create(
        model=brine_server.model, prompt="Hi", max_tokens=2, extra_body={"cache_salt": salt}
    )
    assert completion.choices[0].text is not None
    assert "x" * 1017 not in brine_server.log_tail(10**9)  # never logged, whatever the log level shows


@pytest.mark.parametrize("salt", ["", "s" * 1025, 12, None, ["a"], {"k": "v"}, False], ids=repr)
def test_bad_salt_is_a_400_on_cache_salt(
    client: openai.OpenAI, brine_server: BrineServer, salt: object
) -> None:
    for call in (
        lambda: client.chat.completions.create(
            model=brine_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={"cache_salt": salt},
        ),
        lambda: client.completions.create(
            model=brine_server.model, prompt="Hi", max_tokens=2, extra_body={"cache_salt": salt}
        ),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.param == "cache_salt" and exc.value.code == "invalid_cache_salt"
        assert exc.value.type == "invalid_request_error"
        if isinstance(salt, str) and salt:
            assert salt not in exc.value.message


def test_shared_prefix_hits_only_under_the_same_salt(
    client: openai.OpenAI, brine_server: BrineServer
) -> None:
    prefix = "Read this list and answer.\n" + _document() + "\nQuestion: "
    tenant_a, tenant_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    first_tokens, first = _cached(client, brine_server.model, prefix + "which word is first?", tenant_a)
    assert first_tokens > 150 and first == 0
    _, second = _cached(client, brine_server.model, prefix + "which word is last?", tenant_a)
    # Every full block of the shared prefix except the one at the join with the question.
    assert second > 0 and second >= first_tokens - 48
    _, other = _cached(client, brine_server.model, prefix + "which word is first?", tenant_b)
    assert other == 0  # another salt never reads tenant A's blocks
    _, unsalted = _cached(client, brine_server.model, prefix + "which word is first?", None)
    assert unsalted == 0
