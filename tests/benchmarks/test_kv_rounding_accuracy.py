"""`benchmarks/kv_rounding_accuracy.py`'s llama.cpp cache types round as ggml does: the same values as the gguf
package's quantize and dequantize (its reference implementation, bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from benchmarks.kv_rounding_accuracy import ROUNDINGS


@pytest.mark.parametrize(
    "name,qtype", [("q8_0", GGMLQuantizationType.Q8_0), ("q4_0", GGMLQuantizationType.Q4_0)]
)
def test_a_llama_cpp_cache_type_rounds_as_gguf_does(name: str, qtype: GGMLQuantizationType) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 64, generator=g) * torch.logspace(-3, 2, 40)[:, None, None]  # small to large heads
    x[0, 0, :32] = 0  # an all-zero block
    x[1, 1, 5] = -x[1, 1].abs().max() * 2  # a negative value of largest magnitude (q4_0's d takes its sign)
    want = quants.dequantize(quants.quantize(x.numpy().reshape(-1, 64), qtype), qtype).reshape(x.shape)
    got = ROUNDINGS[name](x).numpy()
    assert np.array_equal(got, want)
    assert not np.array_equal(got, x.numpy())  # it did round


def test_the_float_types_are_casts() -> None:
    x = torch.tensor([1.0 + 2**-12, 500.0, -3e-5])
    assert torch.equal(ROUNDINGS["float16"](x), x.half().float())
    assert torch.equal(ROUNDINGS["fp8_e4m3"](x), x.to(torch.float8_e4m3fn).float())
