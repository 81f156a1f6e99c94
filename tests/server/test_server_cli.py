"""`brine serve` argument parsing and wiring (engine, stat loggers, app, uvicorn), without loading a model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

import engine.model.loading.files as model_files
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from metrics.prometheus import PrometheusStatLogger
from server import cli, serve


def _config(*argv: str, env: dict[str, str] | None = None) -> tuple[EngineConfig, list[str]]:
    args = cli.build_parser().parse_args(["serve", *argv])
    return serve.engine_config(args, []), cli.api_keys(args, env or {})


def test_defaults_match_engine_config() -> None:
    config, keys = _config()
    assert config == EngineConfig()
    assert keys == []


def test_flags_map_to_engine_config() -> None:
    config, keys = _config(
        "/models/x",
        "--no-enable-prefix-caching",
        "--block-size=32",
        "--prefix-caching-hash-algo=xxhash",
        "--num-kv-blocks=100",
        "--max-num-seqs=8",
        "--max-num-batched-tokens=512",
        "--max-model-len=1024",
        "--dtype=float32",
        "--device=cpu",
        "--served-model-name=mine",
        "--api-key=a",
        "--api-key=b",
        env={"BRINE_API_KEY": "c"},
    )
    assert config.model == "/models/x" and config.enable_prefix_caching is False
    assert (config.block_size, config.prefix_caching_hash_algo, config.num_blocks) == (32, "xxhash", 100)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (8, 512, 1024)
    assert (config.dtype, config.device, config.served_model_name) == ("float32", "cpu", "mine")
    assert keys == ["a", "b", "c"]


def test_kv_cache_memory_parses_sizes() -> None:
    assert _config("--kv-cache-memory=512MiB")[0].kv_cache_memory == 512 * 2**20


@pytest.mark.parametrize(
    "argv",
    [
        ["--block-size=0"],
        ["--prefix-caching-hash-algo=md5"],
        ["--kv-cache-memory=lots"],
        ["--port=x"],
        ["--port=70000"],  # else the model loads for nothing and uvicorn dies with a traceback
        ["--port=-1"],
    ],
)
def test_bad_flags_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--host", "--port", "--enable-prefix-caching", "--no-enable-prefix-caching", "--block-size",
        "--prefix-caching-hash-algo", "--kv-cache-memory", "--num-kv-blocks", "--max-num-seqs",
        "--max-num-batched-tokens", "--max-model-len", "--dtype", "--device", "--served-model-name",
        "--api-key", "--log-level", "cache_salt", "BRINE_API_KEY", "--tenants", "--salt-header",
        "--require-cache-salt", "--public-prefix", "--threads",
    ):  # fmt: skip
        assert flag in text, flag


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_serve_wires_engine_metrics_and_app(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    seen: dict[str, Any] = {}
    fake = FakeEngine(model_name="served", num_blocks=10, block_size=16)

    def resolve(name: str | None) -> model_files.ModelFiles:
        seen["resolved"] = name
        return model_files.ModelFiles("resolved-name", tmp_path, "test source")

    def from_config(config: EngineConfig, *, prestart_grammar_workers: bool = False) -> FakeEngine:
        seen["config"], seen["prestart"] = config, prestart_grammar_workers
        return fake

    def run(app: Any, engine: Any, *, host: str, port: int, log_level: str, log_config: dict) -> int:
        seen["uvicorn"] = (host, port, log_level)
        seen["access_filters"] = log_config["handlers"]["access"]["filters"]
        client = TestClient(app)
        seen["unauthorized"] = client.get("/v1/models").status_code
        seen["metrics"] = client.get("/metrics", headers={"Authorization": "Bearer k"}).text
        seen["engine"] = engine
        return 0

    monkeypatch.setattr(model_files, "resolve_model", resolve)
    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(from_config))
    monkeypatch.setattr("server.supervise.run", run)
    caplog.set_level(logging.INFO)
    assert cli.main(["serve", "m", "--port", "9", "--api-key", "k", "--log-level", "warning"]) == 0
    config = seen["config"]
    assert seen["resolved"] == "m" and config.model == str(tmp_path)
    assert seen["prestart"]  # the grammar workers boot with the server, not on its first constrained request
    assert config.served_model_name == "resolved-name"
    assert any(isinstance(s, PrometheusStatLogger) for s in config.stat_loggers)
    assert seen["uvicorn"] == ("127.0.0.1", 9, "warning")
    assert seen["access_filters"] == ["drop_query_string"]  # the access log drops query strings
    assert seen["unauthorized"] == 401 and "brine_kv_cache_usage_perc" in seen["metrics"]
    assert seen["engine"] is fake  # watched: its death ends the server
    assert not fake.healthy  # shut down when uvicorn returned


def test_serve_exits_with_the_supervisors_status(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A dead engine's status reaches `brine`'s exit code (the console script exits with main's value)."""
    from server import supervise

    fake = FakeEngine(model_name="served", num_blocks=10, block_size=16)
    monkeypatch.setattr(model_files, "resolve_model", lambda n: model_files.ModelFiles("x", tmp_path, "src"))
    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(lambda config, **kw: fake))
    monkeypatch.setattr("server.supervise.run", lambda *a, **k: supervise.EXIT_ENGINE_DEAD)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    assert cli.main(["serve"]) == supervise.EXIT_ENGINE_DEAD
    assert not fake.healthy


def test_serve_logs_what_it_loaded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    fake = FakeEngine(model_name="served", num_blocks=10, block_size=16)
    monkeypatch.setattr(model_files, "resolve_model", lambda n: model_files.ModelFiles("x", tmp_path, "src"))

    def from_config(config: EngineConfig, **kw: Any) -> FakeEngine:
        fake.enable_prefix_caching = config.enable_prefix_caching
        return fake

    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(from_config))
    monkeypatch.setattr("server.supervise.run", lambda *a, **k: 0)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)  # keep caplog's handler
    caplog.set_level(logging.INFO, logger="brine.serve")
    cli.main(["serve", "--no-enable-prefix-caching"])
    text = caplog.text
    assert "loading x from src" in text and "160 tokens" in text
    assert "prefix caching: off (--no-enable-prefix-caching)" in text


def test_serve_reports_a_missing_model(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def missing(name: str | None) -> None:
        raise model_files.ModelNotFoundError("cannot find model 'nope'")

    monkeypatch.setattr(model_files, "resolve_model", missing)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    assert cli.main(["serve", "nope"]) == 1
    assert "cannot find model 'nope'" in caplog.text


def test_serve_with_tenants_and_public_prefixes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from server.tenants import key_hash

    fake = FakeEngine(model_name="served", num_blocks=10, block_size=4)
    monkeypatch.setattr(model_files, "resolve_model", lambda n: model_files.ModelFiles("x", tmp_path, "src"))
    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(lambda config, **kw: fake))
    seen: dict[str, Any] = {}

    def run(app: Any, engine: Any, *, host: str, port: int, log_level: str, log_config: dict) -> int:
        client = TestClient(app)
        seen["tenant_metrics"] = client.get("/metrics", headers={"Authorization": "Bearer tk"}).status_code
        seen["tenant_models"] = client.get("/v1/models", headers={"Authorization": "Bearer tk"}).status_code
        return 0

    monkeypatch.setattr("server.supervise.run", run)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    caplog.set_level(logging.INFO, logger="brine.serve")
    tenants = tmp_path / "tenants.txt"
    tenants.write_text(f"acme-corp {key_hash('tk')}\n")
    system = tmp_path / "system.json"
    system.write_text('[{"role": "system", "content": "You are the assistant of a shop."}]')
    text = tmp_path / "manual.txt"
    text.write_text("The manual says:\n")
    argv = ["serve", "--api-key", "op", "--tenants", str(tenants), "--public-prefix", str(system),
            "--public-prefix", str(text)]  # fmt: skip
    assert cli.main(argv) == 0
    assert len(fake.public_prefixes) == 2 and all(fake.public_prefixes)
    assert seen == {"tenant_metrics": 403, "tenant_models": 200}
    assert "1 tenant(s), 1 key(s)" in caplog.text and "acme-corp" not in caplog.text
    assert "public prefix" in caplog.text
    # A key that is both the operator's and a tenant's, and a malformed line, refuse to start.
    assert cli.main(["serve", "--api-key", "tk", "--tenants", str(tenants)]) == 1
    tenants.write_text("acme-corp\n")
    caplog.clear()
    assert cli.main(["serve", "--tenants", str(tenants)]) == 1
    assert "line 1" in caplog.text
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli.main(["serve", "--public-prefix", str(bad)]) == 1


def test_brine_serve_lets_openmp_threads_spin_longer_unless_the_operator_chose():
    from server.cli import OMP_SPIN_COUNT, omp_spin_default

    env: dict[str, str] = {}
    assert omp_spin_default(env) and env == {"GOMP_SPINCOUNT": OMP_SPIN_COUNT}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(chosen)
        assert not omp_spin_default(env) and env == chosen
