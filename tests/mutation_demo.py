"""Issue 18's demonstration: each named bug, applied by hand to a scratch copy of the tree, makes a named test fail.

For every mutation below: copy the tree (without .venv, .git, mutants), check that the chosen tests pass on the
clean copy, apply the one-line edit, run the same tests again, record which failed, and throw the copy away (the
working tree is never touched). Prints a Markdown table; `--out FILE` also writes it there.

    .venv/bin/python tests/mutation_demo.py                 # all but the real-server ones (~15 min on 2 cores)
    .venv/bin/python tests/mutation_demo.py --slow          # also those (e2e tests, minutes each)
    .venv/bin/python tests/mutation_demo.py auth-prefix     # one, by name
    .venv/bin/python tests/mutation_demo.py --list

Each mutation's edit must match its file exactly once, so a refactor that moves the code makes the script say
so instead of testing nothing. Not part of `make test`: it runs pytest itself, many times.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(
    ".venv*", ".git", "mutants", "__pycache__", ".*_cache", ".hypothesis", "*.egg-info"
)


@dataclass(slots=True)
class Mutation:
    name: str
    bug: str  # what the edit breaks, as the issue names it
    path: str
    old: str
    new: str
    tests: list[str] = field(default_factory=list)
    slow: bool = False  # its tests start the real server (marked slow): minutes, not seconds


MUTATIONS = [
    Mutation(
        "auth-prefix",
        "ApiKeyMiddleware accepts any token that starts with a valid key",
        "server/auth.py",
        "operator |= hmac.compare_digest(token, key)",
        "operator |= token.startswith(key)",
        ["tests/server/test_server_auth_salt.py"],
    ),
    Mutation(
        "stream-cached-tokens",
        "streaming /v1/completions drops usage.prompt_tokens_details.cached_tokens",
        "server/serving.py",
        "        async for p, out in stream:\n            for c in self._outputs(p, out):\n                for chunk in",
        "        async for p, out in stream:\n"
        "            out = __import__('dataclasses').replace(out, num_cached_tokens=0)  # the stream path only\n"
        "            for c in self._outputs(p, out):\n                for chunk in",
        ["tests/server/test_server_streaming.py"],
    ),
    Mutation(
        "generate-no-abort",
        "AsyncEngine.generate no longer aborts on aclose() / cancellation",
        "engine/async_engine.py",
        "if not finished:\n                self._inbox.put(_Abort(request_id))",
        "if not finished:\n                pass",
        [
            "tests/engine/test_async_engine.py::test_closing_the_iterator_aborts_and_frees_blocks",
            "tests/engine/test_async_engine.py::test_cancelling_the_consumer_aborts",
        ],
    ),
    Mutation(
        "rmsnorm-bf16",
        "RMSNorm computed in the activations' dtype (bf16) instead of fp32",
        "engine/model/layers/norm.py",
        "        xf = x.float()\n",
        "        xf = x\n",
        ["tests/engine/test_model_numerics.py"],
    ),
    Mutation(
        "rmsnorm-eps-x100",
        "RMSNorm eps x100 (passed the old CUDA bf16 tolerance when replayed on CPU)",
        "engine/model/layers/norm.py",
        "keepdim=True) + self.eps)",
        "keepdim=True) + self.eps * 100)",
        ["tests/engine/test_model_numerics.py"],
    ),
    Mutation(
        "rope-theta-x1.05",
        "rope_theta x1.05 (passed the old CUDA bf16 tolerance when replayed on CPU)",
        "engine/model/layers/rotary.py",
        "inv = 1.0 / (cfg.rope_theta ** (",
        "inv = 1.0 / ((cfg.rope_theta * 1.05) ** (",
        ["tests/engine/test_model_numerics.py"],
    ),
    Mutation(
        "attn-scale-x1.05",
        "attention scale x1.05 (passed the old CUDA bf16 tolerance when replayed on CPU)",
        "engine/model/models/llama.py",
        "self.scale = cfg.head_dim**-0.5",
        "self.scale = cfg.head_dim**-0.5 * 1.05",
        ["tests/engine/test_model_numerics.py"],
    ),
    Mutation(
        "llama3-smooth-x0.9",
        "llama3 RoPE smoothing scaled by 0.9",
        "engine/model/layers/rotary.py",
        "smooth = (old_len / wavelen - low) / (high - low)",
        "smooth = 0.9 * (old_len / wavelen - low) / (high - low)",
        ["tests/engine/test_model_numerics.py"],
    ),
    Mutation(
        "linear-rope-dropped",
        "linear RoPE scaling dropped",
        "engine/model/layers/rotary.py",
        'inv = inv / p["factor"]',
        "inv = inv",
        ["tests/engine/test_model_numerics.py"],
    ),
    Mutation(
        "server-drops-salt",
        "the server no longer hands a request's cache_salt to the engine",
        "server/tenancy.py",
        "return CacheNamespace(tenant=tenant, gateway=gateway, salt=salt)",
        "return CacheNamespace(tenant=tenant, gateway=gateway, salt=None)",
        ["tests/server/test_server_auth_salt.py"],
    ),
    Mutation(
        "cache-ignores-salt",
        "the KV cache no longer separates salts (the engine's side of salt isolation)",
        "kv_cache/namespace.py",
        'out.append(("cache_salt", self.salt))',
        "pass",
        ["tests/kv_cache", "tests/engine/test_async_engine.py::test_reset_prefix_cache_and_cache_salt"],
    ),
    Mutation(
        "reset-route-skips-engine",
        "POST /reset_prefix_cache answers {reset: true} without asking the engine",
        "server/app.py",
        "if not await anyio.to_thread.run_sync(engine.reset_prefix_cache):",
        "if not True:",
        ["tests/server/test_server_routes.py"],
    ),
    Mutation(
        "reset-keeps-hashes",
        "the engine's prefix-cache reset leaves the cached hashes findable",
        "kv_cache/block_pool.py",
        "        self._cached.clear()\n        self._dups.clear()\n",
        "        self._dups.clear()\n",
        ["tests/kv_cache", "tests/engine/test_async_engine.py::test_reset_prefix_cache_and_cache_salt"],
    ),
    Mutation(
        "server-drops-stop",
        "the server no longer hands stop strings to the engine",
        "server/params.py",
        "stop=[s for s in stop if s],",
        "stop=[],",
        ["tests/server/test_server_chat.py"],
    ),
    Mutation(
        "stop-across-tokens",
        "the engine misses a stop string that spans two tokens",
        "engine/detokenizer.py",
        "idx = self.text.find(stop, max(0, before - len(stop) + 1))",
        "idx = self.text.find(stop, before)",
        ["tests/engine/test_detokenizer.py"],
    ),
    Mutation(
        "server-drops-ignore-eos",
        "the server no longer hands ignore_eos to the engine",
        "server/params.py",
        "ignore_eos=bool(req.ignore_eos),",
        "ignore_eos=False,",
        ["tests/server/test_server_chat.py"],
    ),
    Mutation(
        "engine-ignores-eos",
        "the engine no longer stops a sequence at EOS",
        "engine/scheduler.py",
        "if not params.ignore_eos and token in self.eos_token_ids:",
        "if False:",
        ["tests/engine/test_scheduler.py", "tests/engine/test_engine_limits.py"],
    ),
    Mutation(
        "disconnect-no-abort",
        "a client disconnect mid-stream no longer aborts the engine request",
        "server/generation.py",
        # Closing the engine's generators alone is an abort too (AsyncEngine.generate aborts on aclose), so
        # the bug is a close() that does neither.
        "        if self._closed:\n            return\n",
        "        if True:\n            return\n",
        ["tests/server/test_server_streaming.py"],
    ),
    Mutation(
        "dead-step-keeps-lock",
        "a step that dies keeps the core lock (health probes then hang)",
        "engine/async_engine.py",
        "                with self._core_lock:\n"
        "                    for cmd in commands:  # in order: an abort's last output before a new request by its id\n"
        "                        if not isinstance(cmd, _Stop):\n"
        "                            self._dispatch(self._apply(cmd))\n"
        "                    outputs = self._core.step() if self._core.has_work() else []\n",
        "                self._core_lock.acquire()  # released only when the step returns\n"
        "                for cmd in commands:\n"
        "                    if not isinstance(cmd, _Stop):\n"
        "                        self._dispatch(self._apply(cmd))\n"
        "                outputs = self._core.step() if self._core.has_work() else []\n"
        "                self._core_lock.release()\n",
        ["tests/engine/test_engine_async_failures.py"],
    ),
    Mutation(
        "n2-children-unseeded",
        "n=2 with a seed: the choices are no longer seeded (the old test_n2 checked only indexes and content)",
        "engine/engine_core.py",
        "params, n=1, seed=None if params.seed is None else params.seed + i",
        "params, n=1, seed=None",
        ["tests/e2e/test_e2e_chat.py::test_n2"],
        slow=True,
    ),
    Mutation(
        "streamed-delta-clipped",
        "streamed chat deltas lose their first character (the old concurrency test checked only all(results))",
        "server/serving_chat.py",
        'delta = {"content": c.text}',
        'delta = {"content": c.text[1:]}',
        ["tests/e2e/test_e2e_chat.py::test_async_client_concurrent_requests"],
        slow=True,
    ),
]


@dataclass(slots=True)
class Outcome:
    mutation: Mutation
    clean_ok: bool
    failed: list[str]
    seconds: float

    def row(self) -> str:
        m = self.mutation
        tests = " ".join(m.tests)
        if not self.clean_ok:
            verdict = "**clean run failed: not judged**"
        elif self.failed:
            verdict = "killed by " + ", ".join(_grouped(self.failed))
        else:
            verdict = "**SURVIVED**"
        return f"| `{m.name}` | {m.bug} | `{m.path}` | `{tests}` | {verdict} | {self.seconds:.0f} s |"


def _grouped(ids: list[str]) -> list[str]:
    """Failed test ids per test function: `file::name` (and how many of its parametrizations failed)."""
    counts: dict[str, int] = {}
    for test_id in ids:
        base = test_id.split("[", 1)[0]
        counts[base] = counts.get(base, 0) + 1
    return [f"`{base}`" + (f" ({n} cases)" if n > 1 else "") for base, n in counts.items()]


def run_pytest(tree: Path, tests: list[str], slow: bool) -> tuple[int, list[str]]:
    """pytest's exit code and the ids of the failed tests, in the scratch tree (its root first on sys.path,
    so it shadows the editable install)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rf",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        "-m",
        "not cuda" if slow else "not slow and not cuda",
        *tests,
    ]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=1800)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.MULTILINE)
    return proc.returncode, sorted(set(failed))


def demonstrate(m: Mutation) -> Outcome:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="brine-mutation-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=IGNORE)
        target = tree / m.path
        source = target.read_text()
        if source.count(m.old) != 1:
            raise SystemExit(f"{m.name}: the edit matches {source.count(m.old)} times in {m.path}, not once")
        clean_code, _ = run_pytest(tree, m.tests, m.slow)
        target.write_text(source.replace(m.old, m.new))
        code, failed = run_pytest(tree, m.tests, m.slow) if clean_code == 0 else (0, [])
        if clean_code == 0 and code != 0 and not failed:
            failed = [f"pytest exit code {code}"]
    return Outcome(m, clean_code == 0, failed, time.monotonic() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--slow", action="store_true", help="also the mutations whose tests start a real server"
    )
    args = parser.parse_args()
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        print("\n".join(f"{m.name:26} {m.bug}" for m in MUTATIONS))
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutations: {unknown}")
    chosen = (
        [by_name[n] for n in args.names] if args.names else [m for m in MUTATIONS if args.slow or not m.slow]
    )
    lines = [
        "| mutation | bug | file | tests run | result (clean copy passes first) | time |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    survived = 0
    for m in chosen:
        outcome = demonstrate(m)
        survived += not (outcome.clean_ok and outcome.failed)
        lines.append(outcome.row())
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
