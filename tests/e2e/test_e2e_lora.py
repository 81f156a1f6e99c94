"""LoRA adapters end to end: `brine serve --enable-lora --lora-modules tone=DIR` on the real default model,
through the openai SDK, with tenants of which one may use the adapter, one may not, and one is not limited.

/v1/models lists the adapter with `parent` = the base model; a chat naming it runs it (other tokens than the
base model's, the same tokens every time), its blocks are never the base model's (cached_tokens 0) but hit
under the adapter; a tenant not allowed the adapter gets the unknown model's 404 in generation and in
/v1/models; the operator loads and unloads an adapter at run time (vLLM's routes and answers), which a
tenant's key cannot reach (403).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from e2e_server import BrineServer, make_client, running_server

from server.tenants import key_hash

pytestmark = pytest.mark.slow

KEYS = {name: f"sk-{name}-{uuid.uuid4().hex}" for name in ("allowed", "denied", "open")}
PROMPT = "Write one sentence about a lighthouse keeper who collects " + " ".join(["copper"] * 40)


def _adapters(root: Path) -> dict[str, Path]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from lora_helpers import default_model_shapes, write_adapter

    layers, shapes = default_model_shapes()
    return {
        n: write_adapter(root / n, layers, shapes, seed=s, std=0.05) for n, s in (("tone", 1), ("extra", 2))
    }


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrineServer, dict[str, Path]]]:
    tmp = tmp_path_factory.mktemp("lora_e2e")
    paths = _adapters(tmp)
    tenants = tmp / "tenants.txt"
    tenants.write_text(
        f"allowed {key_hash(KEYS['allowed'])} loras=tone\n"
        f"denied {key_hash(KEYS['denied'])} loras=\n"
        f"open {key_hash(KEYS['open'])}\n"
    )
    args = (
        "--enable-lora",
        "--lora-modules",
        f"tone={paths['tone']}",
        "--max-loras",
        "2",
        "--tenants",
        str(tenants),
    )
    with running_server(tmp / "server.log", args) as server:
        yield server, paths


def chat(client: openai.OpenAI, model: str, prompt: str = PROMPT, logprobs: bool = False):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=12,
        temperature=0,
        logprobs=logprobs or None,
    )


def _trace(reply) -> list[tuple[str, float]]:  # noqa: ANN001
    """Each generated token with its logprob: what the model computed, not only what it chose."""
    return [(t.token, t.logprob) for t in reply.choices[0].logprobs.content]


def model_ids(server: BrineServer, key: str) -> dict[str, dict]:
    r = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200
    return {m["id"]: m for m in r.json()["data"]}


def test_models_lists_the_adapter_under_its_parent(lora_server):
    server, _ = lora_server
    ids = model_ids(server, server.api_key)
    assert ids["tone"]["parent"] == server.model and "parent" not in ids[server.model]
    assert set(model_ids(server, KEYS["allowed"])) == {server.model, "tone"}
    assert set(model_ids(server, KEYS["open"])) == {server.model, "tone"}
    assert set(model_ids(server, KEYS["denied"])) == {server.model}
    assert make_client(server).models.retrieve("tone").id == "tone"
    # The startup log says the layers run from Python: the native stack would skip the adapters' deltas.
    assert "layers from Python (--enable-lora)" in server.log_path.read_text()


def test_chat_with_the_adapter_runs_it_and_caches_apart(lora_server):
    server, _ = lora_server
    client = make_client(server)
    prompt = f"{uuid.uuid4().hex} {PROMPT}"  # nothing cached before
    base = chat(client, server.model, prompt, logprobs=True)
    tuned = chat(client, "tone", prompt, logprobs=True)
    assert tuned.model == "tone" and base.model == server.model
    # The adapter changes the logits: the logprobs differ even where the greedy text does not (12 tokens of a
    # small random adapter's answer matched the base model's for some of the random prompts).
    assert _trace(tuned) != _trace(base)
    # The base model's blocks are not the adapter's: nothing cached; under the adapter, its own blocks hit.
    assert (tuned.usage.prompt_tokens_details.cached_tokens or 0) == 0
    again = chat(client, "tone", prompt, logprobs=True)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert _trace(again) == _trace(tuned)


def test_a_tenant_not_allowed_the_adapter_gets_model_not_found(lora_server):
    server, _ = lora_server
    denied = make_client(server, api_key=KEYS["denied"])
    with pytest.raises(openai.NotFoundError) as hidden:
        chat(denied, "tone")
    with pytest.raises(openai.NotFoundError) as unknown:
        chat(denied, "no-such-adapter")
    assert hidden.value.body["code"] == unknown.value.body["code"] == "model_not_found"
    assert hidden.value.body["message"].replace("tone", "X") == unknown.value.body["message"].replace(
        "no-such-adapter", "X"
    )
    with pytest.raises(openai.NotFoundError):
        denied.models.retrieve("tone")
    assert chat(make_client(server, api_key=KEYS["allowed"]), "tone").model == "tone"


def test_operator_loads_and_unloads_at_run_time(lora_server):
    server, paths = lora_server
    url, headers = server.base_url, server.headers
    client = make_client(server)
    body = {"lora_name": "extra", "lora_path": str(paths["extra"])}
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEYS['open']}"}
    )
    assert r.status_code == 403  # a tenant's key cannot reach the operator's route
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' added successfully."
    assert "extra" in model_ids(server, server.api_key)
    assert chat(client, "extra").model == "extra"
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"  # already loaded
    third = {"lora_name": "third", "lora_path": str(paths["extra"])}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=third, headers=headers, timeout=120)
    assert r.status_code == 400 and "--max-loras" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"}, headers=headers)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' removed successfully."
    with pytest.raises(openai.NotFoundError):
        chat(client, "extra")
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"}, headers=headers)
    assert r.status_code == 404
    bad = {"lora_name": "bad", "lora_path": str(paths["extra"] / "nowhere")}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=bad, headers=headers, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_metrics_count_requests_per_adapter(lora_server):
    from prometheus_client.parser import text_string_to_metric_families

    server, _ = lora_server
    client = make_client(server)

    def scrape() -> tuple[float, list[dict[str, str]]]:
        r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
        count, info = 0.0, []
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                if s.name == "brine_lora_requests_total" and s.labels["lora_name"] == "tone":
                    count = s.value
                    assert "tenant" not in s.labels
                if s.name == "brine_lora_requests_info":
                    info.append(s.labels)
        return count, info

    before, _ = scrape()
    chat(client, "tone")
    chat(client, server.model)
    after, info = scrape()
    assert after == before + 1  # the base model's request is not the adapter's
    assert len(info) == 1 and info[0]["max_lora"] == "2"
    assert info[0]["running_lora_adapters"] == "" and info[0]["waiting_lora_adapters"] == ""


def test_responses_and_messages_run_the_adapter_too(lora_server):
    """Both routes build a chat request, checked like chat's: the adapter runs and names itself."""
    server, _ = lora_server
    url = server.base_url
    for path, body in (
        ("/v1/responses", {"model": "tone", "input": "Say hello.", "max_output_tokens": 8}),
        ("/v1/messages", {"model": "tone", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = httpx.post(f"{url}{path}", json=body, headers=server.headers, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "tone", (path, r.text[:300])
        denied = httpx.post(
            f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEYS['denied']}"}, timeout=120
        )
        assert denied.status_code == 404, (path, denied.text[:300])
    r = httpx.post(
        f"{url}/v1/messages/count_tokens",
        json={"model": "tone", "messages": [{"role": "user", "content": "Hi"}]},
        headers=server.headers,
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
