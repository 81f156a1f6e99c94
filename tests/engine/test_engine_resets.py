"""A forced prefix-cache reset (a keyless server's, issue 28 section 5) while requests run: their blocks lose
their hashes but keep serving, every output is what the request gets alone, and every block comes back."""

from __future__ import annotations

from engine_fakes import FakeRunner, collect, make_core, run_to_completion

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


def test_a_forced_reset_mid_run_changes_no_output() -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = {"a": list(range(1, 30)), "b": list(range(40, 61))}
    alone = {}
    for rid, ids in prompts.items():
        core = make_core(FakeRunner(num_blocks=128, block_size=4))
        core.add_request(rid, ids, params)
        alone[rid] = collect(run_to_completion(core), rid)

    core = make_core(FakeRunner(num_blocks=128, block_size=4))
    for rid, ids in prompts.items():
        core.add_request(rid, ids, params)
    outputs: list[RequestOutput] = []
    for _ in range(3):
        outputs += core.step()
    assert not core.reset_prefix_cache()  # refused while blocks are held
    assert core.reset_prefix_cache(force=True)
    core.kv_manager.check_invariants()
    assert core.kv_manager.num_cached_blocks == 0
    outputs += run_to_completion(core)
    assert {rid: collect(outputs, rid) for rid in prompts} == alone
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
