"""A cap on the generation requests one namespace has in flight (running or queued in the engine), so that
one client cannot fill the engine's queue for everyone: over the cap is a 429 with `Retry-After`, as OpenAI
answers a rate limit.

The key is the one the engine shares fairly by (`engine.request.fair_share_key`): the tenant, else the
trusted gateway's value, else the salt; requests with no namespace at all share one bucket. So with salt-only
tenancy a client that rotates salts gets more room, as it gets more shares: server-enforced tenancy
(`--tenants`, or a gateway header) is what binds a client to one bucket.

Rule kept here: every `acquire` is released exactly once, by the caller (`OutputStream.close`) or, should
the caller vanish without closing, when its owner object is garbage-collected.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable

from engine.request import fair_share_key
from kv_cache.namespace import CacheNamespace
from server.errors import APIError

RETRY_AFTER_S = 1
# The bucket of requests without any namespace (an open server's or an operator key's unsalted requests).
_UNSALTED = "\0unsalted"  # a NUL cannot start a tenant's, gateway's or salt's key (all are prefixed)


def too_many_requests(cap: int) -> APIError:
    return APIError(
        f"Too many requests in flight: at most {cap} may run or wait at once for one client; retry when an "
        "earlier one has finished.",
        status=429,
        type="requests",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class InflightLimiter:
    """Counts each namespace's generation requests in flight; `cap` 0 counts nothing and never refuses."""

    def __init__(self, cap: int) -> None:
        if cap < 0:
            raise ValueError(f"the cap must be >= 0, got {cap}")
        self.cap = cap
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # released from finalizers too, which may run on any thread

    def in_flight(self, namespace: CacheNamespace | None) -> int:
        with self._lock:
            return self._counts[fair_share_key(namespace, _UNSALTED)]

    def acquire(self, namespace: CacheNamespace | None, owner: object) -> Callable[[], None]:
        """Takes one slot of `namespace`'s, or raises the 429 when it has `cap` already. Returns the release,
        to be called once (more calls do nothing); it also runs when `owner` is garbage-collected."""
        if not self.cap:
            return lambda: None
        key = fair_share_key(namespace, _UNSALTED)
        with self._lock:
            if self._counts[key] >= self.cap:
                raise too_many_requests(self.cap)
            self._counts[key] += 1
        return weakref.finalize(owner, self._release, key)

    def _release(self, key: str) -> None:
        with self._lock:
            self._counts[key] -= 1
            if not self._counts[key]:
                del self._counts[key]
