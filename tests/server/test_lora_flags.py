"""LoRA's flags and the --tenants file's loras= field: what parses, and what is refused with the reason."""

from __future__ import annotations

import pytest

from server.cli import build_parser, main
from server.lora_access import parse_tenant_loras
from server.serve import engine_config
from server.tenants import TenantsFileError, parse_tenants

H1, H2, H3 = "a" * 64, "b" * 64, "c" * 64


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["serve", "--enable-lora", "--lora-modules", "tone=/x/tone", "ex=/y", "--max-loras", "3",
         "--max-lora-rank", "16"]
    )  # fmt: skip
    config = engine_config(args, [])
    assert config.enable_lora and config.max_loras == 3 and config.max_lora_rank == 16
    assert list(config.lora_modules) == [("tone", "/x/tone"), ("ex", "/y")]
    assert not engine_config(build_parser().parse_args(["serve"]), []).enable_lora


@pytest.mark.parametrize(
    "argv, why",
    [
        (["serve", "--lora-modules", "tone=/x"], "--lora-modules needs --enable-lora"),
        (["serve", "--enable-lora", "--lora-modules", "tone"], "expected NAME=PATH"),
        (["serve", "--enable-lora", "--max-loras", "0"], "positive integer"),
    ],
)
def test_bad_flags_are_usage_errors(argv, why, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and why in capsys.readouterr().err


def test_tenant_lines_may_limit_adapters():
    text = f"acme {H1} loras=tone,ex\nacme {H2} loras=tone,ex\nnone {H3} loras=\nopen {'d' * 64}\n"
    assert set(parse_tenants(text).values()) == {"acme", "none", "open"}
    assert parse_tenant_loras(text) == {"acme": frozenset({"tone", "ex"}), "none": frozenset()}


def test_bad_loras_fields_are_refused():
    with pytest.raises(TenantsFileError, match="line 1: the third field, if any, must be loras="):
        parse_tenants(f"acme {H1} tone\n")
    with pytest.raises(ValueError, match="line 2: this tenant's loras= differs"):
        parse_tenant_loras(f"acme {H1} loras=tone\nacme {H2}\n")
