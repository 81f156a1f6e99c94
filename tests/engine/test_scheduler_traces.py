"""Recorded scheduler traces: seeded random workloads replayed step by step, each step's chunks compared with
what this scheduler scheduled when they were recorded.

The rule-level tests (test_scheduler*.py) pin each rule in a small case; mutation testing (`make mutate`) showed
that a share computed with `/` or `max(2, ...)`, an owner's tokens counted with `=` instead of `+=`, or a
preemption victim picked one position off still passed all of them, because a later step or the top-up evens
the outcome out. These workloads were picked (out of 1,500 seeded ones) because each one tells such a bug
apart at some step. They are a regression net, not a specification: after a deliberate change to the
scheduling rules, check the new schedules against the module docstring and re-record them
(`python tests/engine/test_scheduler_traces.py` prints the current ones).

A step is written as `rid:tokens ...`, with `!n` when n sequences were preempted; every sampled token is 50
(never EOS), every prompt is distinct (no prefix hits), blocks hold 4 tokens.
"""

from __future__ import annotations

import sys

import pytest

from engine.config import EngineConfig
from engine.outputs import RunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from kv_cache import KVCacheManager

# (num_blocks, max_num_seqs, max_num_batched_tokens, [(step, request id, owner, prompt length, max_tokens)])
Workload = tuple[int, int, int, list[tuple[int, str, str, int, int]]]

TRACES: dict[int, tuple[Workload, list[str]]] = {
    123: (
        (
            9,
            3,
            7,
            [
                (3, "r0", "b", 4, 1),
                (3, "r1", "c", 18, 3),
                (2, "r2", "a", 6, 2),
                (2, "r3", "c", 11, 2),
                (1, "r4", "a", 14, 1),
                (4, "r5", "b", 3, 1),
                (2, "r6", "c", 15, 1),
            ],
        ),
        [
            "",
            "r4:7",
            "r4:3 r3:3 r2:1",
            "r4:3 r3:2 r0:2 !1",
            "r4:1 r3:4 r0:2",
            "r3:2 r2:3 r5:2",
            "r3:1 r2:2 r5:1",  # r2 reuses the token its preempted partial block held
            "r2:1 r6:5 r1:1",
            "r6:7",
            "r6:3 r1:4",
            "r1:7",
            "r1:6",
            "r1:1",
            "r1:1",
        ],
    ),
    0: (
        (30, 4, 4, [(4, "r0", "b", 13, 3), (3, "r1", "b", 19, 2), (4, "r2", "a", 10, 2)]),
        [
            "",
            "",
            "",
            "r1:4",
            "r1:2 r0:1 r2:1",
            "r1:2 r0:1 r2:1",
            "r1:2 r0:1 r2:1",
            "r1:2 r0:1 r2:1",
            "r1:2 r0:1 r2:1",
            "r1:2 r0:1 r2:1",
            "r1:2 r0:1 r2:1",
            "r1:1 r0:1 r2:2",
            "r1:1 r0:2 r2:1",
            "r0:3 r2:1",
            "r0:1",
            "r0:1",
        ],
    ),
    380: (
        (
            14,
            3,
            38,
            [(4, "r0", "b", 8, 5), (6, "r1", "a", 20, 5), (2, "r2", "b", 22, 5), (2, "r3", "b", 9, 5)],
        ),
        [
            "",
            "",
            "r2:22 r3:9",
            "r2:1 r3:1",
            "r2:1 r3:1 r0:8",
            "r2:1 r3:1 r0:1",
            "r2:1 r1:20 !2",
            "r1:1 r3:9 r0:10",
            "r1:1 r0:1",
            "r1:1 r0:1",
            "r1:1",
        ],
    ),
    13: (
        (
            22,
            3,
            13,
            [
                (1, "r0", "c", 5, 2),
                (5, "r1", "c", 6, 2),
                (0, "r2", "c", 7, 3),
                (0, "r3", "b", 5, 5),
                (0, "r4", "b", 5, 1),
                (6, "r5", "b", 15, 4),
            ],
        ),
        [
            "r2:7 r3:5 r4:1",
            "r2:1 r3:1 r4:4",
            "r2:1 r3:1 r0:5",
            "r3:1 r0:1",
            "r3:1",
            "r1:6",
            "r1:1 r5:12",
            "r5:3",
            "r5:1",
            "r5:1",
            "r5:1",
        ],
    ),
    91: (
        (
            11,
            5,
            13,
            [
                (5, "r0", "a", 13, 4),
                (6, "r1", "c", 15, 4),
                (3, "r2", "b", 8, 2),
                (4, "r3", "b", 16, 2),
                (6, "r4", "a", 13, 1),
                (6, "r5", "a", 22, 4),
            ],
        ),
        [
            "",
            "",
            "",
            "r2:8",
            "r2:1 r3:12",
            "r3:4 r0:9",
            "r3:1 r0:4 r1:4 r4:4",
            "r0:1 r1:6 r4:5 r5:1",
            "r0:1 r1:5 !2",
            "r0:1 r1:1",
            "r1:1 r4:5 r5:7",
            "r1:1 r5:12",
            "r5:3",
            "r5:1",
            "r5:1",
            "r5:1",
        ],
    ),
    107: (
        (
            21,
            5,
            39,
            [
                (5, "r0", "c", 14, 4),
                (6, "r1", "b", 5, 4),
                (4, "r2", "a", 9, 3),
                (4, "r3", "a", 22, 3),
                (6, "r4", "b", 7, 2),
                (4, "r5", "a", 5, 5),
                (1, "r6", "a", 12, 1),
            ],
        ),
        [
            "",
            "r6:12",
            "",
            "",
            "r2:9 r3:22 r5:5",
            "r2:1 r3:1 r5:1 r0:14",
            "r2:1 r3:1 r5:1 r0:1 r1:5",
            "r5:1 r0:1 r1:1 r4:7",
            "r5:1 r0:1 r1:1 r4:1",
            "r1:1",
        ],
    ),
    108: (
        (
            14,
            6,
            7,
            [
                (3, "r0", "c", 9, 4),
                (1, "r1", "a", 10, 2),
                (1, "r2", "a", 11, 2),
                (0, "r3", "a", 3, 5),
                (3, "r4", "a", 18, 3),
                (5, "r5", "b", 7, 5),
            ],
        ),
        [
            "r3:3",
            "r3:1 r1:6",
            "r3:1 r1:4 r2:2",
            "r3:1 r1:1 r2:1 r0:3 r4:1",
            "r3:1 r2:2 r0:3 r4:1",
            "r2:2 r0:2 r4:1 r5:2",
            "r2:3 r0:1 r4:1 r5:2",
            "r2:1 r0:1 r4:3 r5:2",
            "r2:1 r0:1 r4:4 r5:1",
            "r0:1 r4:5 r5:1",
            "r4:2 r5:1",
            "r4:1 r5:1",
            "r4:1 r5:1",
        ],
    ),
    168: (
        (
            13,
            5,
            25,
            [(1, "r0", "a", 18, 2), (1, "r1", "c", 17, 4), (4, "r2", "a", 20, 4), (0, "r3", "a", 14, 5)],
        ),
        [
            "r3:14",
            "r3:1 r0:12 r1:12",
            "r3:1 r0:6 !1",
            "r3:1 r0:1",
            "r3:1 r1:5 r2:11",
            "r1:1 r2:9",
            "r1:1 r2:1",
            "r1:1 r2:1",
            "r2:1",
        ],
    ),
    427: (
        (
            16,
            5,
            33,
            [
                (2, "r0", "a", 6, 3),
                (0, "r1", "c", 1, 5),
                (5, "r2", "c", 16, 3),
                (3, "r3", "c", 11, 4),
                (4, "r4", "c", 11, 5),
                (5, "r5", "a", 11, 2),
                (6, "r6", "b", 18, 2),
            ],
        ),
        [
            "r1:1",
            "r1:1",
            "r1:1 r0:6",
            "r1:1 r0:1 r3:11",
            "r1:1 r0:1 r3:1 r4:11",
            "r3:1 r4:1 r5:11 r2:16",
            "r3:1 r4:1 r5:1 r6:18 !1",
            "r4:1 r6:1 r2:17",
            "r4:1 r2:1",
        ],
    ),
    450: (
        (
            12,
            4,
            11,
            [(0, "r0", "a", 19, 4), (0, "r1", "c", 1, 2), (3, "r2", "c", 20, 5), (0, "r3", "a", 21, 3)],
        ),
        [
            "r0:9 r1:1 r3:1",
            "r0:9 r1:1 r3:1",
            "r0:1 r3:10",
            "r0:1 r3:5 r2:5",
            "r0:1 r2:10 !1",
            "r0:1 r2:5",
            "r2:1 r3:10",
            "r2:1 r3:10",
            "r2:1 r3:1",
            "r2:1 r3:1",
            "r3:1",
        ],
    ),
    488: (
        (
            13,
            5,
            22,
            [
                (5, "r0", "c", 13, 3),
                (4, "r1", "b", 12, 2),
                (3, "r2", "a", 21, 4),
                (4, "r3", "b", 9, 1),
                (4, "r4", "b", 22, 3),
            ],
        ),
        [
            "",
            "",
            "",
            "r2:21",
            "r2:1 r1:12 r3:8 r4:1",
            "r2:1 r1:1 r0:7 !2",
            "r2:1 r0:6 r3:7 r4:1",
            "r0:1 r3:2 r4:19",
            "r0:1 r4:2",
            "r4:1",
            "r4:1",
        ],
    ),
}


def replay(workload: Workload) -> list[str]:
    num_blocks, max_num_seqs, budget, adds = workload
    kv = KVCacheManager(num_blocks, 4)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64)
    sched = Scheduler(kv, config, eos_token_ids=[0])
    steps: list[str] = []
    for t in range(60):
        for at, rid, owner, n, max_tokens in adds:
            if at == t:
                start = 1000 * (int(rid[1:]) + 1)
                params = SamplingParams(temperature=0, max_tokens=max_tokens)
                req = Request(rid, list(range(start, start + n)), params, owner=owner)
                req.hasher = kv.make_hasher()
                assert req.hasher is not None
                req.hasher.extend(req.block_hashes, req.all_token_ids)
                sched.add_request(req)
        out = sched.schedule()
        sched.update(out, RunnerOutput({s.request_id: 50 for s in out.scheduled if s.sample}, {}))
        sched.check_invariants()
        kv.check_invariants()
        step = " ".join(f"{s.request_id}:{len(s.new_token_ids)}" for s in out.scheduled)
        preempted = sched.take_num_preemptions()
        steps.append(step + (f" !{preempted}" if preempted else ""))
    while steps and not steps[-1]:
        steps.pop()
    assert not sched.requests, "every request finishes within 60 steps"
    return steps


@pytest.mark.parametrize("seed", sorted(TRACES))
def test_the_recorded_schedule_is_replayed_step_by_step(seed: int) -> None:
    workload, expected = TRACES[seed]
    assert replay(workload) == expected


if __name__ == "__main__":  # re-record: prints the current traces in this file's format
    for seed, (workload, _) in sorted(TRACES.items()):
        print(f"    {seed}: (\n        {workload!r},\n        {replay(workload)!r},\n    ),", file=sys.stdout)
