"""Worker processes that die with the server: the grammar sandbox's compilers (engine.grammar_sandbox) and
`/detokenize`'s decoders (server.detokenize_pool).

A worker is started with `python -c` (multiprocessing's spawn would import the parent's main module again, a
benchmark script or a test runner, in the child), runs `module.function(fd)` and speaks over a socket pair with
`multiprocessing.connection` framing.

Why a second channel: a worker that waits on its socket sees EOF when the server goes, but one that is busy
(a long compile, a decode) or still importing (xgrammar imports torch: ~2 s) does not look until it is done, so
a server killed with SIGKILL left its workers running for a second or more, each holding a core and memory. So
every worker also gets the read end of a pipe that nothing ever writes; the server holds the write end, and
only the kernel closes it, when the server process ends, however it ends. The worker asks for a signal when
that fd changes (O_ASYNC), and sets that signal to SIGKILL (Linux's F_SETSIG): the kernel kills the worker the
moment its server is gone, whatever the worker is doing, without its Python code (or its GIL) having to run.
PR_SET_PDEATHSIG would be simpler but follows the thread that started the child, and the threads that start
workers (a route's worker thread) end long before the server. Elsewhere than Linux a worker exits on its
socket's EOF only.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

_F_SETSIG = 10  # fcntl.h on Linux (Python's fcntl module does not name it)


class WorkerProcess:
    """One worker: `proc` (its Popen) and `conn` (the server's end of its socket). The worker runs
    `function(fd)` of `module` (fd: its end of the socket), after `die_with_parent`, before anything else."""

    def __init__(self, module: str, function: str, *, nice: int = 0) -> None:
        """`nice`: added to the worker's CPU niceness, so that its work yields the cores to the server's."""
        parent, child = socket.socketpair()
        death_read, self._death_write = os.pipe()  # both non-inheritable: no other child holds the write end
        entry = (
            "import sys; from engine.worker_process import die_with_parent; "
            f"die_with_parent(int(sys.argv[2]), {int(nice)}); from {module} import {function}; "
            f"{function}(int(sys.argv[1]))"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", entry, str(child.fileno()), str(death_read)],
                pass_fds=(child.fileno(), death_read),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
            os.close(death_read)
        self.conn = Connection(parent.detach())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)
        self.conn.close()
        if self._death_write >= 0:
            os.close(self._death_write)
            self._death_write = -1


def die_with_parent(fd: int, nice: int = 0) -> None:
    """In a worker, first: be killed by the kernel once the write end of pipe `fd` closes (the server ended),
    and lower this process's CPU priority by `nice`. Linux only; a no-op elsewhere."""
    if nice:
        os.nice(nice)
    if not sys.platform.startswith("linux"):
        return
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, _F_SETSIG, signal.SIGKILL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    # The server may have gone before the line above armed the signal: nothing is ever written to the pipe,
    # so a readable fd means its write end is closed.
    if select.select([fd], [], [], 0)[0]:
        os._exit(0)
