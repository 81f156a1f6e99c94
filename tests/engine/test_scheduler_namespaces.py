"""Fair shares by cache namespace (issue 28, section 4): the engine shares by the request's tenant, gateway
value or salt, so a flood of requests under one salt holds one share, not one per request. Fake runner and
the real scheduler: step counts, not times, so the result is the same on every machine."""

from __future__ import annotations

from engine_fakes import FakeRunner, collect, make_core, run_to_completion

from engine.engine_core import EngineCore
from engine.outputs import RequestOutput
from engine.request import Origin, Request, fair_share_key
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace

FLOOD = 80


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def prompt(n: int, start: int) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(n)]


def steps_until_first_token(core: EngineCore, request_id: str, seen: list[RequestOutput]) -> int:
    for n in range(1, 1001):
        outputs = core.step()
        core.kv_manager.check_invariants()
        core.scheduler.check_invariants()
        seen += outputs
        if any(o.request_id == request_id and any(c.token_ids for c in o.outputs) for o in outputs):
            return n
    raise AssertionError(f"{request_id} got no token in 1000 steps")


def flooded_core(namespace_of_flood: CacheNamespace) -> EngineCore:
    """The engine after a few steps of 80 long requests under one namespace, each its own API request."""
    core = make_core(FakeRunner(num_blocks=2048, block_size=4), max_num_seqs=16, max_num_batched_tokens=64)
    for i in range(FLOOD):
        core.add_request(f"flood-{i}", prompt(12, start=i), params(60), origin=Origin(namespace_of_flood))
    for _ in range(5):
        core.step()
    assert len(core.scheduler.running) == 16 and len(core.scheduler.waiting) == FLOOD - 16
    return core


def idle_steps(namespace: CacheNamespace) -> int:
    core = make_core(FakeRunner(num_blocks=2048, block_size=4), max_num_seqs=16, max_num_batched_tokens=64)
    core.add_request("victim", prompt(20, start=200), params(4), origin=Origin(namespace))
    n = steps_until_first_token(core, "victim", [])
    run_to_completion(core)
    return n


def test_another_salt_is_scheduled_promptly_beside_a_flood_under_one_salt() -> None:
    victim_ns = CacheNamespace(salt="b")
    idle = idle_steps(victim_ns)
    core = flooded_core(CacheNamespace(salt="a"))
    seen: list[RequestOutput] = []
    core.add_request("victim", prompt(20, start=200), params(4), origin=Origin(victim_ns))
    # Shared per request, the victim would be one owner of 81 with a share of 1 slot, every flood request
    # at its share too: it would wait behind the 64 queued flood requests for hundreds of steps.
    waited = steps_until_first_token(core, "victim", seen)
    assert waited <= 3 * idle, (waited, idle)
    # Two owners: the flood holds at most its half of the slots while the victim runs.
    owners = [r.owner for r in core.scheduler.running]
    assert owners.count(fair_share_key(CacheNamespace(salt="a"), "")) <= 15
    seen += run_to_completion(core)
    assert collect(seen, "victim")  # it finished, and every block came back
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_a_tenant_is_one_share_whatever_salts_it_rotates() -> None:
    # Server-enforced tenancy: 80 requests of tenant A, each under a fresh salt, still hold one share.
    core = make_core(FakeRunner(num_blocks=2048, block_size=4), max_num_seqs=16, max_num_batched_tokens=64)
    for i in range(FLOOD):
        ns = CacheNamespace(tenant="A", salt=f"rotated-{i}")
        core.add_request(f"flood-{i}", prompt(12, start=i), params(60), origin=Origin(ns))
    for _ in range(5):
        core.step()
    seen: list[RequestOutput] = []
    core.add_request("victim", prompt(20, start=200), params(4), origin=Origin(CacheNamespace(tenant="B")))
    assert steps_until_first_token(core, "victim", seen) <= 3 * idle_steps(CacheNamespace(tenant="B"))
    run_to_completion(core)
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_the_fair_share_key_is_the_namespace_then_the_api_request() -> None:
    a1 = fair_share_key(CacheNamespace(tenant="a", salt="s1"), "req-1")
    assert a1 == fair_share_key(CacheNamespace(tenant="a", salt="s2"), "req-2")
    assert a1 != fair_share_key(CacheNamespace(tenant="b"), "req-1")
    g = fair_share_key(CacheNamespace(gateway="g", salt="x"), "r1")
    assert (
        g
        == fair_share_key(CacheNamespace(gateway="g"), "r2")
        != fair_share_key(CacheNamespace(tenant="g"), "")
    )
    # Salt-only tenancy: one share per salt, whatever the request.
    s = fair_share_key(CacheNamespace(salt="s"), "r1")
    assert (
        s == fair_share_key(CacheNamespace(salt="s"), "r2") != fair_share_key(CacheNamespace(salt="t"), "r1")
    )
    assert s != fair_share_key(CacheNamespace(tenant="s"), "r1")
    # No namespace: each API request is its own owner (its prompts share the id the server passes).
    assert fair_share_key(None, "r1") != fair_share_key(None, "r2")
    assert fair_share_key(CacheNamespace(), "r1") == "r1"


def test_the_request_derives_its_owner_from_its_namespace() -> None:
    salted = Request("x", [1, 2], params(1), CacheNamespace(salt="a"), owner="api-1")
    assert salted.owner == fair_share_key(CacheNamespace(salt="a"), "")
    assert Request("y", [1, 2], params(1), None, owner="api-1").owner == "api-1"
    assert Request("z", [1, 2], params(1)).owner == "z"


def test_one_origin_record_carries_the_namespace_and_the_group_to_every_sequence() -> None:
    """The server hands the engine one `Origin`; the engine derives each sequence's namespace, hasher and
    fair share from it (the namespace's key where there is one, else the group's, else the request's)."""
    core = make_core(FakeRunner(num_blocks=64, block_size=4))
    salted = Origin(CacheNamespace(salt="s"), group="api-1")
    core.add_request("a", prompt(8, start=1), SamplingParams(max_tokens=2, n=2), origin=salted)
    core.add_request("b-0", prompt(8, start=1), params(2), origin=Origin(group="api-2"))
    core.add_request("b-1", prompt(8, start=1), params(2), origin=Origin(group="api-2"))
    core.add_request("c", prompt(8, start=1), params(2))
    reqs = core.scheduler.requests
    assert {reqs[r].owner for r in ("0_a", "1_a")} == {fair_share_key(CacheNamespace(salt="s"), "")}
    assert all(reqs[r].namespace == CacheNamespace(salt="s") for r in ("0_a", "1_a"))
    assert reqs["b-0"].owner == reqs["b-1"].owner == "api-2" and reqs["b-0"].namespace is None
    assert reqs["c"].owner == "c"
    # The salt reaches the block hashes: the unsalted prompt shares no block with the salted one.
    assert reqs["0_a"].block_hashes[0] != reqs["c"].block_hashes[0] == reqs["b-0"].block_hashes[0]
    run_to_completion(core)
