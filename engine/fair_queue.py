"""The scheduler's waiting queue: one FIFO per owner, served round-robin.

An owner is whoever the scheduler shares fairly between (`engine.request.fair_share_key`): the request's cache
namespace (tenant, gateway value, else salt), or without one its API request (all its prompts and n sequences). Within an owner requests keep their arrival order; between
owners the turn passes on after each admission, so 12,800 waiting sequences of one request delay another
request's first sequence by one turn, not by 12,800.

Rules: `pop(req)` is for the request just admitted (its owner's turn ends); `remove(req)` for one that leaves
without running (an abort). A preempted request goes back to the front of its owner's queue and that owner to
the front of the turn order, so preemption never costs a request its place.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from engine.request import Request


class FairQueue:
    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[Request]] = OrderedDict()  # turn order: the first is next
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in the order admission would consider them (owner by owner)."""
        for queue in self._queues.values():
            yield from queue

    def append(self, req: Request) -> None:
        queue = self._queues.get(req.owner)
        if queue is None:
            queue = self._queues[req.owner] = deque()
        queue.append(req)
        self._len += 1

    def push_front(self, req: Request) -> None:
        """A preempted request: first of its owner, and its owner first in turn."""
        queue = self._queues.get(req.owner)
        if queue is None:
            queue = self._queues[req.owner] = deque()
        queue.appendleft(req)
        self._queues.move_to_end(req.owner, last=False)
        self._len += 1

    def heads(self) -> Iterator[tuple[str, Request]]:
        """(owner, its oldest waiting request) in turn order."""
        for owner, queue in self._queues.items():
            yield owner, queue[0]

    def pop(self, req: Request) -> None:
        """Takes an owner's head that is being admitted; the turn passes to the next owner."""
        queue = self._queues[req.owner]
        if queue[0] is not req:
            raise ValueError(f"request {req.request_id!r} is not the head of its owner's queue")
        queue.popleft()
        self._len -= 1
        if queue:
            self._queues.move_to_end(req.owner)
        else:
            del self._queues[req.owner]

    def remove(self, req: Request) -> None:
        """Takes out a request that leaves while waiting; the turn order is unchanged."""
        queue = self._queues[req.owner]
        queue.remove(req)
        self._len -= 1
        if not queue:
            del self._queues[req.owner]

    def owners(self) -> Iterator[str]:
        return iter(self._queues)
