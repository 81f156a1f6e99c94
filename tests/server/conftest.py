"""Fixtures for server tests: a fake engine, the app over it, and a TestClient (no model, no network)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL

from server.app import create_app


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(model_name=MODEL)


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as c:
        yield c
