"""`POST /detokenize`'s whole work, from the body's bytes to the answer's, and the worker processes it runs in.

Why not the event loop, nor a thread: a 32,768-id body is ~230 KB of JSON. Parsing it (`json.loads`), checking
its strings for lone surrogates and validating it took ~5-10 ms of the event loop per request, and decoding it
~17 ms more in a worker thread, whose Python parts (the vocabulary check) held the GIL that the engine's step
thread needs between its native calls. A client sending such bodies back to back kept the loop ~90% busy
(py-spy, 2-core EPYC), and every other tenant's stream waited behind it. A worker process holds none of the
server's GIL, and runs at a lower CPU priority (`NICE`), so that on a busy machine the engine's forward and the
event loop get the cores first. The loop only hands the bytes over and sends back the bytes it gets. A small
body (server.token_routes.IN_PROCESS_BYTES) is answered in a thread instead: well under a millisecond of GIL.

`answer()` is the route's behaviour, the same in a worker and in process (a tokenizer that cannot be sent to
a worker, as the tests' fakes, is answered in a thread): the body read as FastAPI reads a typed body (JSON
when the Content-Type says so or is absent), validated as `DetokenizeRequest`, then the checks the route has
always made, in its order, with its errors.

Workers (engine.worker_process) die with the server and start on demand, when a large body finds none idle
(about a second for that body: most servers never see one, and each worker holds ~95 MB with the default
model's tokenizer), and one that dies is replaced; at most `workers` run, as many as the route lets decode at
once.
"""

from __future__ import annotations

import email.message
import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pydantic import ValidationError
from pydantic_core import to_json
from starlette.responses import JSONResponse

from engine.worker_process import WorkerProcess
from server.errors import SERVER_ERROR, APIError, bad_request, error_body, validation_error
from server.params import check_model
from server.protocol import DetokenizeRequest
from server.text_check import check_text

logger = logging.getLogger("brine.server")

WORKERS = 2
NICE = 10  # added niceness of a worker: the engine's threads and the event loop win the cores


@dataclass(slots=True)
class Job:
    body: bytes
    content_type: str | None
    model_name: str
    max_tokens: int  # --max-detokenize-tokens


@dataclass(slots=True)
class Answer:
    status: int
    body: bytes  # JSON
    logs: list[tuple[int, str]]  # (level, message) of what answering logged, to log in the server


def answer(job: Job, decode: Callable[[list[int]], str], vocab_size: int | None) -> Answer:
    """The route's answer to one body; never raises for the client's input."""
    try:
        req = _parse(job.body, job.content_type)
        check_text(req)
        check_model(req.model, job.model_name)
        if len(req.tokens) > job.max_tokens:
            raise bad_request(
                f"Invalid 'tokens': at most {job.max_tokens} token ids per request, got {len(req.tokens)}.",
                "tokens",
                "array_above_max_length",
            )
        if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in req.tokens):
            raise bad_request("tokens contains a token id outside the vocabulary.", "tokens")
        return Answer(200, to_json({"prompt": decode(req.tokens)}), [])
    except APIError as exc:
        return Answer(exc.status, bytes(JSONResponse(exc.body()).body), [])


class _Captured(logging.Handler):
    """In a worker, what answering logs (an unknown field's warning, a refused surrogate), for the server to
    log where its logging is set up."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(message)s"))  # a traceback, where there is one, follows
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, self.format(record)))


def _parse(body: bytes, content_type: str | None) -> DetokenizeRequest:
    """The body as FastAPI reads a typed body (the app is lenient: no Content-Type reads as JSON), with the
    errors its handlers give: bad JSON, undecodable bytes, not an object, a field's validation."""
    data: Any = body
    if body and _is_json(content_type):
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            raise bad_request(
                "We could not parse the JSON body of your request.", code="invalid_json"
            ) from None
        except Exception:  # undecodable bytes: FastAPI's 400 for a body it cannot read
            raise APIError("There was an error parsing the body", code="bad_request") from None
    try:
        return DetokenizeRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class DetokenizePool:
    def __init__(self, tokenizer_json: str, vocab_size: int | None, workers: int = WORKERS) -> None:
        """`tokenizer_json`: the Rust tokenizer (`tokenizers.Tokenizer.to_str()`) the workers decode with.
        Starts no worker: `run` starts them as they are needed."""
        self._init = (tokenizer_json, vocab_size)
        self.workers = workers
        self._idle: queue.Queue[WorkerProcess] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._all: list[WorkerProcess] = []  # started and not dead: at most `workers`

    def run(self, job: Job) -> Answer:
        """Blocks (call it from a worker thread) until a worker has answered `job`. A worker found dead (killed
        from outside: nothing the client sends kills one) is replaced and the job given to another, until a fresh
        worker has had it."""
        attempts = self.workers + 1  # every worker that was idle may be dead; then a fresh one
        for attempt in range(attempts):
            worker = self._take()
            healthy = False
            try:
                worker.conn.send(job)
                result: Answer = worker.conn.recv()
                healthy = True
                break
            except (EOFError, OSError):
                if attempt == attempts - 1:
                    raise RuntimeError("a /detokenize worker process died") from None
            finally:
                self._give_back(worker, healthy)
        for level, message in result.logs:
            logger.log(level, "%s", message)  # the worker's "brine.server" lines, in the server's log
        return result

    def _spawn(self) -> WorkerProcess | None:
        with self._lock:
            if self._closed or len(self._all) >= self.workers:
                return None
            worker = WorkerProcess("server.detokenize_pool", "worker_main", nice=NICE)
            self._all.append(worker)
        worker.conn.send(self._init)  # waits in the socket until the worker has started
        return worker

    def _take(self) -> WorkerProcess:
        if self._closed:
            raise RuntimeError("the /detokenize pool is closed")
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        return self._spawn() or self._idle.get()

    def _give_back(self, worker: WorkerProcess, healthy: bool) -> None:
        if healthy:
            self._idle.put(worker)
            return
        worker.kill()
        with self._lock:
            self._all.remove(worker)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            worker.kill()


def worker_main(fd: int) -> None:
    """A worker process: answers each `Job` it is sent with an `Answer`, until the server closes the socket."""
    import os

    from tokenizers import Tokenizer

    conn = Connection(fd)
    tokenizer_json, vocab_size = conn.recv()
    backend = Tokenizer.from_str(tokenizer_json)

    def decode(ids: list[int]) -> str:
        # As engine.tokenizer.Tokenizer.decode (special tokens skipped); a worker holds no GIL the server needs.
        return backend.decode(ids, skip_special_tokens=True)

    captured = _Captured()
    root = logging.getLogger()
    root.addHandler(captured)
    root.setLevel(logging.DEBUG)  # the server's own level decides what is shown
    while True:
        try:
            job = conn.recv()
        except EOFError:
            os._exit(0)
        try:
            result = answer(job, decode, vocab_size)
        except Exception:  # a bug, not the client's input: a 500, its traceback in the server's log
            logger.exception("/detokenize failed in its worker")
            failed = JSONResponse(error_body("internal server error", type=SERVER_ERROR))
            result = Answer(500, bytes(failed.body), [])
        result.logs, captured.records = captured.records, []
        conn.send(result)
