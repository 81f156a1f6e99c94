"""A token-id prompt is checked against the smaller of the model's and the tokenizer's vocabularies (the
engine's `vocab_size`), not the tokenizer's alone: a 400 naming `prompt` before anything reaches the engine."""

from __future__ import annotations

from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL, assert_error, completion_body

from server.app import create_app


def test_an_id_past_the_models_vocabulary_is_a_400_naming_prompt() -> None:
    engine = FakeEngine(model_name=MODEL, model_vocab_size=100)
    assert engine.tokenizer.vocab_size > 150
    client = TestClient(create_app(engine))
    for prompt in ([1, 150], [[1, 2], [3, 100]]):
        err = assert_error(client.post("/v1/completions", json=completion_body(prompt)), 400, "prompt")
        assert "vocabulary" in err["message"]
    assert not engine.calls  # refused before the engine saw any of it
    assert client.post("/v1/completions", json=completion_body([1, 99])).status_code == 200
    assert client.get("/health").status_code == 200


def test_the_engines_up_front_refusal_is_a_400_naming_prompt() -> None:
    # A prompt the server did not build from ids (a chat template's tokens) is checked by the engine.
    from engine.errors import PromptTokenError
    from server.generation import engine_error

    err = engine_error(PromptTokenError(100))
    assert err.status == 400 and err.body()["error"]["param"] == "prompt"
