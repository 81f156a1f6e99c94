"""Makes torch.cpu's CPUID helpers answer as an emulated tier's CPU would (benchmarks/compare.py, TIER_CPUID).

benchmarks.compare puts this folder on PYTHONPATH of the servers that pick their own kernels by those helpers
(vLLM CPU: its C++ extension and its attention's ISA), with BRINE_TORCH_CPUID naming the answers as JSON. Python
imports `sitecustomize` at start-up in every process of that environment, vLLM's engine-core processes included.
"""

import json
import os
from collections.abc import Callable


def _answer(value: bool) -> Callable[[], bool]:
    return lambda: value


def _patch() -> None:
    answers = json.loads(os.environ.get("BRINE_TORCH_CPUID") or "{}")
    if not answers:
        return
    import torch.cpu

    for name, value in answers.items():
        if not hasattr(torch.cpu, name):
            raise RuntimeError(f"BRINE_TORCH_CPUID: torch.cpu has no {name}")
        setattr(torch.cpu, name, _answer(bool(value)))


_patch()
