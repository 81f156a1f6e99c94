"""Refusing text that is not valid Unicode: JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), which Python
decodes into a `str` that no UTF-8 encoder, tokenizer or response writer accepts.

`check_text(req)` runs first in every route that reads text (before the model check, whose 404 names the
model): a request holding one is a 400 naming the field, logged as one line, never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from server.errors import CACHE_SALT, bad_request

logger = logging.getLogger("brine.server")


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string (a key or a value) inside `value` holds a lone surrogate. Iterative: the depth
    json.loads allowed must not become a RecursionError here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, (list, tuple)):
            # A prompt of token ids is thousands of ints: skip them here rather than test each four times below.
            stack.extend(x for x in item if type(x) is not int)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, BaseModel):
            stack.extend(getattr(item, name) for name in type(item).model_fields)
    return False


def check_text(req: BaseModel) -> None:
    """A 400 naming the first field of `req` that holds a lone surrogate; `cache_salt` first, with its own
    code, as every bad salt is refused for its salt."""
    for name in sorted(type(req).model_fields, key=lambda name: name != CACHE_SALT):
        if _has_lone_surrogate(getattr(req, name)):
            # One line, no traceback: each such request used to log two ~80-line tracebacks.
            logger.info("refused a request: a lone UTF-16 surrogate in %s", name)
            code = "invalid_cache_salt" if name == CACHE_SALT else "invalid_text"
            raise bad_request(
                f"{name} contains a lone UTF-16 surrogate, which is not valid Unicode text.", name, code
            )
