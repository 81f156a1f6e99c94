"""benchmarks.compare under an emulated lower tier: every server must run under the same ISA caps, MKL's too
(torch's float32 GEMM is MKL's, which ONEDNN_MAX_CPU_ISA does not cap)."""

from __future__ import annotations

from benchmarks.compare import TIER_CAPS, apply_tier_caps


def test_an_emulated_tier_sets_every_cap_the_caller_left_unset():
    env = {"BRINE_CPU_TIER": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    note = apply_tier_caps(env)
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert note is not None and "MKL_ENABLE_INSTRUCTIONS=AVX2" in note and "upper bound" in note


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
