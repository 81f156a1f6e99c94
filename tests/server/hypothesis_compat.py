"""Compatibility shim: hypothesis-jsonschema 0.23 (used by schemathesis 3.x to generate request bodies) calls
`hypothesis.internal.conjecture.utils.many(...).more()`, which newer Hypothesis releases replaced with a
context-manager + iterator API. Without `more()` every object-valued body fails to generate
("'many' object has no attribute 'more'"). This adds `more()` on top of the new API, only when it is missing.
Remove once the environment pins a Hypothesis that still has it, or hypothesis-jsonschema is updated.
"""

from __future__ import annotations

from hypothesis.internal.conjecture import utils as cu


def _more(self: cu.many) -> bool:
    it = getattr(self, "_compat_iter", None)
    if it is None:
        self.__enter__()
        it = self._compat_iter = iter(self)  # type: ignore[attr-defined]
    try:
        next(it)
        return True
    except StopIteration:
        self.__exit__(None)
        return False


def install() -> None:
    if hasattr(cu.many, "more"):
        return
    cu.many.more = _more  # type: ignore[attr-defined]
