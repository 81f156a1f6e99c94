"""The e2e server handle and SDK client factory, shared by tests/e2e/conftest.py and the test modules."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600  # the first start converts the GGUF; a busy 2-core machine is slow
API_KEY = "e2e-test-key"
NUM_KV_BLOCKS = 512  # 8192 tokens: plenty for these tests, and far less memory than the 2 GiB default


@dataclass(slots=True)
class BrineServer:
    base_url: str
    api_key: str
    model: str
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int) -> list[str]:
    exe = ROOT / ".venv" / "bin" / "brine"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "server.cli"]
    return [
        *base, "serve", "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
        "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "8", "--log-level", "info",
    ]  # fmt: skip


def make_client(server: BrineServer, *, api_key: str | None = None, strict: bool = True) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key=api_key or server.api_key,
        max_retries=0,
        timeout=300,
        _strict_response_validation=strict,
    )
