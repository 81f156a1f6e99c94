"""Worker processes die with the server (engine.worker_process): a server killed with SIGKILL takes its grammar
compilers with it, at once, even a worker that is not reading its socket (busy in a compile, still importing
xgrammar; here: stopped with SIGSTOP, which is the strongest case: it can run no code at all)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for `brine serve`: starts the sandbox's workers, prints their pids, then waits to be killed.
SERVER = """
import sys, time
import xgrammar as xgr
from engine.grammar_sandbox import CompileSandbox
vocab = [chr(ord("a") + i) for i in range(26)] + [str(i) for i in range(10)] + ["{", "}", '"', ":"]
info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=40, stop_token_ids=[0])
sandbox = CompileSandbox(info, workers=1)
sandbox.prestart()
for worker in sandbox._all:
    worker.wait_ready(None)  # past its start: armed, and waiting on its socket
print(" ".join(str(w.proc.pid) for w in sandbox._all), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, waiting to be reaped by whoever adopted it) is not alive."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def pids_of_workers(server_code: str) -> tuple[subprocess.Popen[str], list[int]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = subprocess.Popen(
        [sys.executable, "-c", server_code], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    assert server.stdout is not None
    line = server.stdout.readline()
    assert line.strip(), f"the server printed no worker pids (exit {server.poll()})"
    return server, [int(p) for p in line.split()]


def check_workers_die_with_their_server(server_code: str) -> None:
    server, workers = pids_of_workers(server_code)
    try:
        assert len(workers) >= 1 and all(alive(p) for p in workers)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)  # they cannot see their socket close, nor run any code
        server.kill()
        server.wait(timeout=30)
        deadline = time.monotonic() + 10  # a bound for a loaded machine, not a speed figure
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(alive(p) for p in workers), "workers outlived their server"
    finally:
        server.kill()
        for pid in workers:  # only where the test failed: the workers it made
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the kernel's kill on parent death is Linux's"
)
def test_grammar_workers_die_with_a_killed_server() -> None:
    check_workers_die_with_their_server(SERVER)
