"""Workload shapes: what each request of each workload is, independent of any server."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is not an installed package

from benchmarks.workloads import QUESTIONS, build  # noqa: E402


def test_doc_qa_questions_stay_different_past_the_fixed_list() -> None:
    n = 2 * len(QUESTIONS) + 3
    wl = build("doc-qa", seed=5, doc_tokens=40, questions=n)
    prompts = [r.prompt for r in wl.requests]
    # A repeated question would be a full-prompt hit, not a "different question".
    assert len(set(prompts)) == n
    assert [r.tag for r in wl.requests] == ["cold"] + ["warm"] * (n - 1)


def test_tenants_questions_stay_different_per_tenant_past_the_fixed_list() -> None:
    rounds = len(QUESTIONS) + 2
    wl = build("tenants", seed=5, num_tenants=2, doc_tokens=40, rounds=rounds)
    for tenant in ("tenant-0", "tenant-1"):
        prompts = [r.prompt for r in wl.requests if r.group == tenant]
        assert len(prompts) == rounds and len(set(prompts)) == rounds
    # Round-robin: tenants alternate, each under its own salt.
    assert [r.group for r in wl.requests[:4]] == ["tenant-0", "tenant-1", "tenant-0", "tenant-1"]
    assert len({r.salt for r in wl.requests}) == 2


def test_prefix_repetition_is_p_by_r_shuffled_with_distinct_suffixes() -> None:
    wl = build("prefix-repetition", seed=5, prefixes=3, repeats=4, prefix_tokens=40, concurrency=2)
    assert wl.concurrency == 2 and len(wl.requests) == 12
    groups = [r.group for r in wl.requests]
    assert sorted(groups) == sorted(f"prefix-{p}" for p in range(3) for _ in range(4))
    assert groups != sorted(groups)  # shuffled, not prefix by prefix
    assert len({r.prompt for r in wl.requests}) == 12


def test_isolation_b_sends_a_first_prompt_under_another_salt() -> None:
    wl = build("isolation", seed=5, doc_tokens=40)
    a_cold, a_warm, b = wl.requests
    assert (a_cold.tag, a_warm.tag, b.tag) == ("cold", "warm", "other-tenant")
    assert b.prompt == a_cold.prompt and a_warm.prompt != a_cold.prompt
    assert a_cold.salt == a_warm.salt != b.salt and b.salt is not None


def test_unique_prompts_share_no_prefix_beyond_the_first_word() -> None:
    wl = build("unique", seed=5, num_requests=6, prompt_tokens=40)
    firsts = {r.prompt.split()[1] for r in wl.requests}  # "Document <random id> ..."
    assert len(firsts) == 6


def test_replicas_waves_put_every_document_in_flight_with_its_session_id() -> None:
    from benchmarks.workloads import replicas  # noqa: PLC0415

    wl = replicas(seed=3, docs=3, doc_tokens=40, questions=2)
    assert [r.wave for r in wl.requests] == [0, 0, 0, 1, 1, 1]
    assert wl.concurrency == 3  # a wave's documents are all in flight at once
    assert [r.tag for r in wl.requests] == ["cold"] * 3 + ["warm"] * 3
    # One session id per document, the same for its questions (consistent_hash pins a document to a replica).
    sessions = [r.headers["X-Session-ID"] for r in wl.requests]
    assert sessions[:3] == sessions[3:] and len(set(sessions)) == 3
    assert all(
        r.prompt.startswith(wl.requests[i % 3].prompt.split("\n\n")[0]) for i, r in enumerate(wl.requests)
    )
