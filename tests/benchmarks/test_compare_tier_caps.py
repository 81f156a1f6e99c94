"""benchmarks.compare under an emulated lower tier: every server must run under the same ISA caps, MKL's too
(torch's float32 GEMM is MKL's, which ONEDNN_MAX_CPU_ISA does not cap), and vLLM CPU, which picks its C++
extension by torch.cpu's CPUID helpers, must hear that tier's answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.compare import TIER_CAPS, TIER_CPUID, apply_tier_caps, tier_cpuid_env


def test_an_emulated_tier_sets_every_cap_the_caller_left_unset():
    env = {"BRINE_CPU_TIER": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    note = apply_tier_caps(env)
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert note is not None and "MKL_ENABLE_INSTRUCTIONS=AVX2" in note
    assert "torch.cpu._is_avx512_supported() = False" in note


def test_a_cap_the_caller_set_is_kept():
    env = {"BRINE_CPU_TIER": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    note = apply_tier_caps(env)
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert env["ONEDNN_MAX_CPU_ISA"] == TIER_CAPS["avx512"]["ONEDNN_MAX_CPU_ISA"]
    assert note is not None and "MKL_ENABLE_INSTRUCTIONS=AVX2" in note


def test_the_machines_own_tier_sets_nothing():
    for tier in (None, "auto", "portable"):
        env = {} if tier is None else {"BRINE_CPU_TIER": tier}
        before = dict(env)
        assert apply_tier_caps(env) is None
        assert env == before
        assert tier_cpuid_env(env) == {}


def _cpuid_answers(env: dict[str, str]) -> dict[str, bool]:
    """torch.cpu's CPUID helpers as a fresh Python process started with `env` sees them."""
    code = "import json, torch.cpu as c; print(json.dumps({n: c.__dict__[n]() for n in dir(c) if n.startswith('_is_')}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tier", ["avx2", "avx512"])
def test_a_server_started_with_the_tiers_cpuid_env_sees_that_tiers_cpu(tier: str):
    base = {k: v for k, v in os.environ.items() if k not in ("BRINE_TORCH_CPUID",)}
    own = _cpuid_answers(base)
    extra = tier_cpuid_env({**base, "BRINE_CPU_TIER": tier})
    seen = _cpuid_answers({**base, **extra})
    for name, value in TIER_CPUID[tier].items():
        assert seen[name] is value, (name, seen)
    # What the tier does not override is the machine's own answer (an Ice Lake keeps AVX512 and VNNI).
    for name in own.keys() - TIER_CPUID[tier].keys():
        assert seen[name] == own[name], name
