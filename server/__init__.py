"""server: the OpenAI-compatible HTTP API over the engine (`create_app`) and the `brine serve` CLI."""
