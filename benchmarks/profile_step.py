"""Where one engine step's time goes: a decode step, a warm prefill step and a cold 5-token prefill step.

In process, no HTTP: an `EngineCore` over the real `ModelRunner` (default model and dtype unless told), driven
step by step. Three passes per scenario, each over `--steps` steps:

- plain: the step as it runs in the server, timed whole (the reference figure); where the layers run in one
  native call (engine.model.models.native_stack), also timed with them run from Python, as `--enforce-eager` does;
- phases (with the layers run from Python, where the parts are visible): the engine's stages and the model's
  parts wrapped in timers (scheduler, runner host work, model forward and inside it attention plan /
  attention / KV write / linears / norms / RoPE / SiLU, sampler, the one host sync, scheduler update, output
  processor with the detokenizer, stats); inclusive medians, ms;
- ops: torch.profiler over the same steps, every aten op's self time charged to the innermost phase it ran
  in (so "attention" splits into its gathers, casts, products and softmax).

The wrappers cost ~1 us each (~400 per decode step): compare `phases`' total with `plain`. Steps run on a
worker thread, as in the server.

`--summarize-pyspy RAW` instead sums a `py-spy record --threads --format raw` file of a running server by
thread and part (engine thread: model parts, scheduler, output processor...; event loop: HTTP/SSE vs idle).

    .venv/bin/python benchmarks/profile_step.py                       # default model, bf16 on CPU
    .venv/bin/python benchmarks/profile_step.py --context 2000 --steps 20 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams

_stack: list[str] = []
_times: dict[str, list[float]] = defaultdict(list)
_step_acc: dict[str, float] = defaultdict(float)
_enabled = False


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, timed into `label` (inclusive, summed over a step) and labelled for torch.profiler."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _enabled or (_stack and _stack[-1] == label):  # nested in itself (fused_ops' torch path)
            return fn(*args, **kwargs)
        _stack.append(label)
        t0 = time.perf_counter()
        with torch.profiler.record_function(label):
            try:
                return fn(*args, **kwargs)
            finally:
                _step_acc[label] += time.perf_counter() - t0
                _stack.pop()

    return wrapper


def instrument(core: EngineCore) -> None:
    """Wrap the stages of a step and the parts of the model, in place (this process only)."""
    import engine.model.layers.activation as activation
    import engine.model.models.llama as llama
    from engine.detokenizer import TextStream
    from engine.model.layers.linear import PackedLinear
    from engine.model.layers.quant_linear import QuantLinear

    sched, runner, model = core.scheduler, core.runner, core.runner.model
    sched.schedule = _timed("scheduler.schedule", sched.schedule)
    sched.update = _timed("scheduler.update", sched.update)
    runner.execute = _timed("runner.execute", runner.execute)
    model.forward = _timed("runner.execute/model.forward", model.forward)
    backend = runner.attn_backend
    backend.plan = _timed("runner.execute/model.forward/attention.plan", backend.plan)
    backend.forward = _timed("runner.execute/model.forward/attention", backend.forward)
    llama.write_slots = _timed("runner.execute/model.forward/kv_write", llama.write_slots)
    llama.apply_rope = _timed("runner.execute/model.forward/rope", llama.apply_rope)
    activation.silu = _timed("runner.execute/model.forward/silu", activation.silu)
    llama.RMSNorm.forward = _timed("runner.execute/model.forward/rmsnorm", llama.RMSNorm.forward)
    # The fused native steps (CPU): the residual add is charged to the RMSNorm it is fused with.
    fused = llama.fused_ops
    fused.rms_norm = _timed("runner.execute/model.forward/rmsnorm", fused.rms_norm)
    fused.add_rms_norm = _timed("runner.execute/model.forward/rmsnorm", fused.add_rms_norm)
    fused.silu_mul = _timed("runner.execute/model.forward/silu", fused.silu_mul)
    fused.rope_and_write = _timed("runner.execute/model.forward/rope+kv_write", fused.rope_and_write)
    PackedLinear.forward = _timed("runner.execute/model.forward/linears", PackedLinear.forward)
    QuantLinear.forward = _timed("runner.execute/model.forward/linears", QuantLinear.forward)
    runner.sampler.__class__.__call__ = _timed("runner.execute/sampler", runner.sampler.__class__.__call__)
    torch.Tensor.tolist = _timed("runner.execute/host_sync(.tolist)", torch.Tensor.tolist)
    core.outputs.process = _timed("output_processor", core.outputs.process)
    TextStream.add_token = _timed("output_processor/detokenizer", TextStream.add_token)
    core._record_stats = _timed("stats", core._record_stats)
    core._publish_events = _timed("kv_events", core._publish_events)


@contextmanager
def step_timer() -> Iterator[None]:
    global _enabled
    _enabled = True
    _step_acc.clear()
    t0 = time.perf_counter()
    yield
    _step_acc["step"] = time.perf_counter() - t0
    _enabled = False
    for k, v in _step_acc.items():
        _times[k].append(v)


def make_core(
    model: str | None,
    dtype: str,
    quantization: str = "auto",
    quantize_activations: str = "none",
    kv_cache_dtype: str = "auto",
) -> EngineCore:
    from engine.config import EngineConfig
    from engine.model.loading.files import resolve_model
    from engine.model_runner import ModelRunner
    from engine.tokenizer import Tokenizer

    files = resolve_model(model)
    config = EngineConfig(
        model=str(files.path),
        dtype=dtype,
        num_blocks=1024,
        max_num_seqs=16,
        quantization=quantization,
        quantize_activations=quantize_activations,
        kv_cache_dtype=kv_cache_dtype,
    )
    return EngineCore(ModelRunner(config), Tokenizer(files.path), config)


def prompt_ids(core: EngineCore, n: int, salt: int) -> list[int]:
    """n token ids of ordinary text (a different start per salt, so no two prompts share a block)."""
    text = " ".join(
        f"Paragraph {salt}: the quick brown fox jumps over the lazy dog near river {i}." for i in range(n)
    )
    ids = core.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    return ids[:n]


class Scenario:
    """Sets up the state before a measured step and runs exactly that step."""

    def __init__(self, core: EngineCore, kind: str, context: int) -> None:
        self.core, self.kind, self.context = core, kind, context
        self.n = 0
        if kind == "decode":
            params = SamplingParams(max_tokens=core.max_model_len - context, ignore_eos=True, temperature=0.0)
            errors = core.add_request("decode", prompt_ids(core, context, 0), params)
            if errors:
                raise SystemExit(f"decode request refused: {errors[0]}")
            while core.scheduler.requests["decode"].num_computed_tokens < context:
                core.step()  # the prefill
        elif kind == "warm_prefill":
            self.prompt = prompt_ids(core, context, 1)
            self._one("warm-seed")  # fills the cache; every later request hits all but its last block

    def _one(self, rid: str) -> None:
        self.core.add_request(rid, self.prompt, SamplingParams(max_tokens=1, temperature=0.0))
        self.core.step()

    def prepare(self) -> None:
        """Queue what the next measured step runs (decode: nothing to add)."""
        self.n += 1
        if self.kind == "warm_prefill":
            # The one-token step over the cached prompt: without its kept logits row (engine.kept_logits), a
            # prompt sent again would compute nothing at all.
            if self.core.kept_logits is not None:
                self.core.kept_logits.clear()
            self.core.add_request(f"w{self.n}", self.prompt, SamplingParams(max_tokens=1, temperature=0.0))
        elif self.kind == "cold_5_token":
            ids = prompt_ids(self.core, 5, 100 + self.n)
            self.core.add_request(f"c{self.n}", ids, SamplingParams(max_tokens=1, temperature=0.0))

    def step(self) -> None:
        self.core.step()


def run(core: EngineCore, kind: str, context: int, steps: int, top: int) -> None:
    sc = Scenario(core, kind, context)
    runner = core.runner
    stack = runner.layer_stack

    def plain_steps() -> list[float]:
        for _ in range(3):  # warm-up
            sc.prepare()
            sc.step()
        times = []
        for _ in range(steps):
            sc.prepare()
            t0 = time.perf_counter()
            sc.step()
            times.append(time.perf_counter() - t0)
        return times

    plain = plain_steps()
    # The phases are only visible where the layers run from Python: time that path too, then break it down.
    runner.layer_stack = None
    eager = plain_steps() if stack is not None else plain
    _times.clear()
    for _ in range(steps):
        sc.prepare()
        with step_timer():
            sc.step()
    print(f"\n## {kind} (context {context if kind != 'cold_5_token' else 5} tokens), {steps} steps")
    how = "layers in one native call" if stack is not None else "layers from Python"
    print(
        f"plain step ({how}): median {1e3 * statistics.median(plain):.2f} ms, min {1e3 * min(plain):.2f} ms"
    )
    if stack is not None:
        print(
            f"plain step, layers from Python (--enforce-eager; the path the phases below break down): "
            f"median {1e3 * statistics.median(eager):.2f} ms, min {1e3 * min(eager):.2f} ms"
        )
    print("| phase (inclusive) | median ms | share of step |")
    print("|---|---:|---:|")
    step = statistics.median(_times["step"])
    for label in sorted(_times, key=lambda k: (k != "step", k)):
        med = statistics.median(_times[label])
        print(f"| {label} | {1e3 * med:.2f} | {100 * med / step:.0f}% |")
    # ops: self time of every aten op, charged to the innermost phase label around it
    global _enabled
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            sc.prepare()
            _enabled = True
            sc.step()
            _enabled = False
    by: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.name.startswith(("runner.", "scheduler.", "output_processor", "stats", "kv_events")):
            continue
        parent, label = ev.cpu_parent, "(outside phases)"
        while parent is not None:
            if "/" in parent.name or parent.name.startswith(("runner.", "scheduler.", "output_", "stats")):
                label = parent.name
                break
            parent = parent.cpu_parent
        cell = by[(label, ev.name)]
        cell[0] += ev.self_cpu_time_total / 1e3 / steps
        cell[1] += 1 / steps
    print(f"\ntop {top} ops by self CPU time per step (torch.profiler), charged to the innermost phase:")
    print("| phase | op | ms per step | calls per step |")
    print("|---|---|---:|---:|")
    for (label, op), (ms, calls) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {label} | {op} | {ms:.2f} | {calls:.0f} |")
    total = sum(ms for ms, _ in by.values())
    # ops the Python code dispatched (an aten op called by another aten op is not counted again)
    top_level = sum(
        1 for ev in prof.events() if ev.name.startswith(("aten::", "mkldnn::")) and _dispatched(ev)
    )
    print(
        f"all ops' self time: {total:.2f} ms per step; ops dispatched from Python: {top_level / steps:.0f} per step"
    )
    runner.layer_stack = stack
    core.abort_request("decode")  # the decode scenario's request must not share the next scenario's steps
    while core.has_work():
        core.step()


# py-spy's frames are "function (file:line)"; a sample goes to the deepest frame naming one of these.
PYSPY_PARTS = [
    ("scheduler", ("Scheduler.",)),
    ("output processor + detokenizer", ("OutputProcessor.", "TextStream.", "IncrementalDetokenizer.")),
    ("stats + KV events", ("EngineCore._record_stats", "EngineCore._publish_events")),
    ("runner host work (lists, metadata, unpack)", ("ModelRunner.execute", "_unpack", "_records")),
    ("sampler", ("Sampler.",)),
    ("model: other ops (embedding, residual adds, views)", ("LlamaForCausalLM.forward", "DecoderLayer")),
    (
        "model: attention layer glue (qkv split, RoPE, KV write)",
        ("Attention.forward", "apply_rope", "write_slots"),
    ),
    ("model: MLP glue (SiLU, mul)", ("MLP.forward", "silu ")),
    ("model: RMSNorm", ("RMSNorm.forward",)),
    ("model: attention planning", ("TiledBackend.plan", "TiledBackend._unit", "TiledBackend._mask")),
    (
        "model: attention (gathers, products, softmax)",
        ("TiledBackend.forward", "TiledBackend._attend", "scores ", "weighted ", "tree_sum"),
    ),
    ("model: linears (packed oneDNN)", ("PackedLinear.forward", "_linear ")),
    ("model: linears (GGUF blocks)", ("QuantLinear.forward",)),
    ("engine thread: waiting for work", ("Queue.get", "Condition.wait")),
    (
        "asyncio: HTTP, SSE, routes",
        ("serving_", "generation", "uvicorn", "starlette", "fastapi", "h11", "_Selector"),
    ),
    ("asyncio: idle (select)", ("select (selectors",)),
]


def summarize_pyspy(path: str) -> None:
    """Samples per thread and per part, from `py-spy record --threads --format raw` output."""
    threads: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        part = "other"
        for frame in frames[1:]:
            for name, keys in PYSPY_PARTS:
                if any(k in frame for k in keys):
                    part = name
        threads[thread][part] += int(count)
    total = sum(sum(p.values()) for p in threads.values())
    for thread, parts in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(parts.values())
        print(f"\n### thread {thread}: {n} samples ({100 * n / total:.0f}% of all)")
        print("| part | samples | share of thread |")
        print("|---|---:|---:|")
        for part, c in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"| {part} | {c} | {100 * c / n:.0f}% |")


def _dispatched(ev: Any) -> bool:
    parent = ev.cpu_parent
    return parent is None or not parent.name.startswith(("aten::", "mkldnn::"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quantization", choices=("auto", "none"), default="auto")
    ap.add_argument("--quantize-activations", choices=("none", "q8"), default="none")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "float16"), default="auto")
    ap.add_argument("--context", type=int, default=2000, help="warm prefill's prompt; decode's context")
    ap.add_argument("--decode-context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--scenarios", default="decode,warm_prefill,cold_5_token")
    ap.add_argument("--summarize-pyspy", metavar="RAW", help="summarize a py-spy --format raw file and exit")
    args = ap.parse_args()
    if args.summarize_pyspy:
        summarize_pyspy(args.summarize_pyspy)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.threads import on_fresh_thread

    # As the server does: loaded on a thread that ends, stepped on another (see engine.threads).
    core = on_fresh_thread(
        lambda: make_core(
            args.model, args.dtype, args.quantization, args.quantize_activations, args.kv_cache_dtype
        ),
        args.threads,
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {core.runner.dtype}, "
        f"attention {core.runner.attention_backend}"
    )
    instrument(core)

    def scenarios() -> None:
        for kind in args.scenarios.split(","):
            ctx = args.decode_context if kind == "decode" else args.context
            run(core, kind, ctx, args.steps, args.top)

    # Steps run on a worker thread, as in the server (`brine-engine`): on a busy machine, torch ops run from
    # the main thread with 2 OpenMP threads measured ~10x slower here (the team spin-waits), from a worker not.
    worker = threading.Thread(target=scenarios, name="brine-engine")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
