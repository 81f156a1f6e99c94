"""ModelRunner: SchedulerOutput in, tokens and logprobs out; checked against transformers.

A small driver plays the scheduler: chunked prefills, a request that starts on another request's blocks in
the same step, decode steps, shuffled block ids. The default model (slow) must answer "Paris" and match
transformers' greedy `generate` token for token.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams


def _hf_greedy(tiny, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(tiny.logits(seq)[-1].argmax()))
    return seq[len(prompt) :]


class Driver:
    """Schedules requests like the real scheduler would: at most `chunk` new tokens per request per step."""

    def __init__(self, runner: ModelRunner, chunk: int, seed: int = 0) -> None:
        self.runner, self.chunk = runner, chunk
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, dict] = {}

    def add(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        shared_blocks: list[int] = (),
        max_len: int = 64,
    ) -> None:
        nb = -(-max_len // self.runner.block_size)
        own = [self.free.pop() for _ in range(nb - len(shared_blocks))]
        self.reqs[rid] = dict(
            tokens=list(prompt),
            prompt=len(prompt),
            computed=len(shared_blocks) * self.runner.block_size,
            blocks=list(shared_blocks) + own,
            params=params,
            out=[],
        )

    def step(self):
        scheduled = []
        for rid, r in self.reqs.items():
            n = min(self.chunk, len(r["tokens"]) - r["computed"])
            start = r["computed"]
            scheduled.append(
                ScheduledRequest(
                    rid,
                    r["tokens"][start : start + n],
                    start,
                    r["blocks"],
                    start + n == len(r["tokens"]),
                    r["params"],
                    r["tokens"],
                    r["prompt"],
                    len(r["out"]),
                )
            )
        result = self.runner.execute(SchedulerOutput(scheduled, sum(len(s.new_token_ids) for s in scheduled)))
        for s in scheduled:
            r = self.reqs[s.request_id]
            r["computed"] += len(s.new_token_ids)
            if s.sample:
                tok = result.sampled_token_ids.pop(s.request_id)
                r["tokens"].append(tok)
                r["out"].append(tok)
        assert not result.sampled_token_ids  # nothing for requests that did not sample
        return result


@pytest.fixture
def runner_for(tiny_model):
    def make(name: str, **kw) -> tuple[ModelRunner, object]:
        tiny = tiny_model(name)
        kw.setdefault("num_blocks", 64)
        config = EngineConfig(model=str(tiny.path), device="cpu", dtype="float32", block_size=4, **kw)
        return ModelRunner(config), tiny

    return make


def test_properties_and_kv_sizing(runner_for):
    runner, _ = runner_for("qwen3", num_blocks=20)
    assert (runner.num_blocks, runner.block_size) == (20, 4)
    assert runner.architecture == "Qwen3ForCausalLM" and runner.is_causal
    assert runner.vocab_size == 128 and runner.max_model_len == 256
    assert runner.device == torch.device("cpu") and runner.dtype == torch.float32
    assert runner.kv_store.k_caches[0].shape == (20, 4, 2, 32)
    per_block = 2 * 2 * 4 * 2 * 32 * 4  # K and V, 2 layers, 4 tokens, 2 kv heads, head_dim 32, float32
    by_memory, _ = runner_for("qwen3", num_blocks=None, kv_cache_memory=10 * per_block + 5)
    assert by_memory.num_blocks == 10


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral_window"])
def test_greedy_generation_matches_transformers(name, runner_for):
    runner, tiny = runner_for(name)
    drv = Driver(runner, chunk=5)
    greedy = SamplingParams(temperature=0.0)
    a = [5, 9, 17, 33, 2, 8, 90, 61, 3, 4, 100, 7, 12]
    b = a[:6] + [44, 45, 46]  # its first block is a's, computed by a in the same first step
    c = [77, 78]
    drv.add("a", a, greedy)
    drv.add("b", b, greedy, shared_blocks=drv.reqs["a"]["blocks"][:1])
    drv.add("c", c, SamplingParams(temperature=0.0, top_k=1))
    for _ in range(10):
        drv.step()
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        out = drv.reqs[rid]["out"]
        assert len(out) >= 6
        assert out == _hf_greedy(tiny, prompt, len(out)), rid


def test_logprobs_and_prompt_logprobs_match_transformers(runner_for):
    runner, tiny = runner_for("llama")
    drv = Driver(runner, chunk=4)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    drv.add("p", prompt, SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2))
    prompt_records, sampled = [], []
    for _ in range(5):  # three chunks of the prompt (4 + 4 + 2), then two decodes
        result = drv.step()
        prompt_records += result.prompt_logprobs.get("p", [])
        if "p" in result.logprobs:
            sampled.append(result.logprobs["p"])
    ref = torch.log_softmax(tiny.logits(drv.reqs["p"]["tokens"]), dim=-1)
    assert [r.token_id for r in prompt_records] == prompt[1:]
    for i, rec in enumerate(prompt_records):  # entry i: logprob of prompt token i + 1
        assert rec.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-4)
        vals, ids = ref[i].topk(2)
        assert [t for t, _ in rec.top] == ids.tolist()
        assert [v for _, v in rec.top] == pytest.approx(vals.tolist(), abs=1e-4)
    out = drv.reqs["p"]["out"]
    assert [r.token_id for r in sampled] == out and len(out) == 3
    for j, rec in enumerate(sampled):
        row = ref[len(prompt) - 1 + j]
        assert rec.logprob == pytest.approx(row.max().item(), abs=1e-4)  # greedy: the top token
        assert [t for t, _ in rec.top] == row.topk(3).indices.tolist()


def test_seeded_sampling_is_reproducible_across_batches(runner_for):
    runner, _ = runner_for("qwen2")
    prompt = [9, 8, 7, 6, 5]
    params = SamplingParams(temperature=1.0, seed=7)

    def run(with_others: bool) -> list[int]:
        drv = Driver(runner, chunk=16, seed=3 if with_others else 4)
        if with_others:
            drv.add("x", [1, 2, 3], SamplingParams(temperature=1.0))
        drv.add("s", prompt, params)
        if with_others:
            drv.add("y", [4] * 9, SamplingParams(temperature=0.8, top_p=0.9))
        for _ in range(8):
            drv.step()
        return drv.reqs["s"]["out"]

    assert run(False) == run(True)


def test_each_step_syncs_with_the_device_once(runner_for, host_syncs):
    # Every sampling feature in one batch: subsets of rows with logprobs, with penalties, with min_tokens,
    # greedy next to random and seeded rows, prompt logprobs, a chunked prefill and a prefix hit. On CUDA any
    # list indexing or blocking copy would make the host wait for the forward pass in the middle of the step.
    runner, _ = runner_for("qwen3")
    drv = Driver(runner, chunk=6)
    a = [5, 9, 17, 33, 2, 8, 90, 61, 3, 4, 100, 7, 12]
    drv.add("greedy", a, SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1))
    seeded = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=3,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        min_tokens=6,
        stop_token_ids=[5],
    )
    drv.add("seeded", a[:4] + [44, 45], seeded, shared_blocks=drv.reqs["greedy"]["blocks"][:1])
    drv.add("plain", [77, 78, 79], SamplingParams(temperature=1.0))
    drv.add("penalised", [1, 1, 2], SamplingParams(temperature=0.0, repetition_penalty=1.5))
    for step in range(5):
        with host_syncs() as syncs:
            drv.step()
        assert [what for what, _ in syncs.events] == ["tolist"], (step, syncs.events)
    assert all(len(r["out"]) >= 3 for r in drv.reqs.values())


@pytest.mark.cuda
def test_cuda_each_step_syncs_once(tiny_model):
    # The real check behind the CPU test above: CUDA's sync debug mode warns on every synchronising call.
    import warnings

    tiny = tiny_model("qwen3")
    runner = ModelRunner(
        EngineConfig(model=str(tiny.path), device="cuda", dtype="float32", block_size=16, num_blocks=64)
    )
    assert runner.attention_backend == "flex"
    params = {
        "greedy": SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1),
        "seeded": SamplingParams(
            temperature=0.8, top_p=0.9, top_k=20, seed=3, frequency_penalty=0.5, min_tokens=9
        ),
        "plain": SamplingParams(temperature=1.0, repetition_penalty=1.2),
    }
    prompt = list(range(3, 40))

    def run(seed: int) -> list[list[tuple[str, int]]]:
        drv = Driver(runner, chunk=24, seed=seed)
        drv.add("greedy", prompt, params["greedy"], max_len=128)
        drv.add("seeded", prompt[:16] + [50, 51], params["seeded"], drv.reqs["greedy"]["blocks"][:1], 128)
        drv.add("plain", [7] * 9, params["plain"], max_len=128)
        per_step = []
        for _ in range(6):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    drv.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            per_step.append([(w.filename, w.lineno) for w in caught if "synchroniz" in str(w.message)])
        return per_step

    run(0)  # compiles flex for these shapes (compilation may sync)
    for step, syncs in enumerate(run(1)):
        assert len(syncs) == 1, (step, syncs)
    assert runner.attention_backend == "flex"


def test_logprobs_of_a_vocabulary_smaller_than_asked(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=12,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    runner = ModelRunner(
        EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", block_size=4, num_blocks=8)
    )
    drv = Driver(runner, chunk=16)
    drv.add("r", [1, 2, 3], SamplingParams(temperature=0.0, logprobs=20, prompt_logprobs=20), max_len=8)
    result = drv.step()
    assert [len(rec.top) for rec in result.prompt_logprobs["r"]] == [12, 12]
    assert len(result.logprobs["r"].top) == 12
    assert sorted(t for t, _ in result.logprobs["r"].top) == list(range(12))


def test_finished_requests_and_bad_tokens(runner_for):
    """A request the step cannot run (an id outside the vocabulary, too few blocks) fails alone: the runner
    says why in `errors`, and the request beside it gets the token it gets without it."""
    runner, _ = runner_for("llama")
    assert runner.execute(SchedulerOutput([], 0)).sampled_token_ids == {}
    greedy = SamplingParams(temperature=0.0)
    good = ScheduledRequest("good", [5, 6, 7], 0, [1], True, greedy, [5, 6, 7], 3, 0)
    alone = runner.execute(SchedulerOutput([good], 3)).sampled_token_ids
    bad = ScheduledRequest("r", [128], 0, [0], True, SamplingParams(), [128], 1, 0)
    negative = ScheduledRequest("neg", [-1], 0, [2], True, SamplingParams(), [-1], 1, 0)
    short = ScheduledRequest("short", [1] * 5, 0, [3], True, SamplingParams(), [1] * 5, 5, 0)
    result = runner.execute(SchedulerOutput([bad, good, negative, short], 10))
    assert "out of range" in result.errors["r"] and "out of range" in result.errors["neg"]
    assert "blocks" in result.errors["short"]
    assert result.sampled_token_ids == alone and "good" not in result.errors
    only_bad = runner.execute(SchedulerOutput([bad], 1))
    assert only_bad.sampled_token_ids == {} and set(only_bad.errors) == {"r"}


@pytest.mark.slow
def test_default_model_answers_paris_and_matches_transformers_generate():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model

    try:
        path = resolve_model(None).path
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    runner = ModelRunner(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=32))
    drv = Driver(runner, chunk=2048)
    drv.add("q", prompt, SamplingParams(temperature=0.0), max_len=len(prompt) + 40)
    for _ in range(32):
        drv.step()
    ours = drv.reqs["q"]["out"]
    assert "Paris" in tok.decode(ours[:12])

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # compare all 32 tokens, past the end of the answer
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert ours == ref[0, len(prompt) :].tolist()
