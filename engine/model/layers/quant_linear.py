"""Linear layers that run a GGUF's quantized weights as stored, with Brine's C++ kernel (kernels/csrc/quant_linear.cpp).

Why: decode streams every weight once per token, so its speed is the weights' size. The default model's GGUF
stores its layers in Q4_1 and its (tied) output head in Q8_0: ~96 MB, where the same weights widened to
bfloat16 are ~270 MB plus a 56 MB packed copy of the head. Keeping the blocks as stored makes a decode step
stream a third of the bytes, and the weights are the file's exact values (d * q + m), which bfloat16 could
not hold.

The GGUF types people download map exactly onto the kernel's record kinds (its header): Q4_1 and Q4_0 (a min of
-8 d, exact in float16) are 4-bit records; Q8_0 and Q5_0 (q - 16) int8 records; Q5_1 int8 with a min; the
K-quants' sub-block scales are products of two small numbers, exact in float32, so Q4_K and Q5_K become records
with float32 scales and mins, and Q6_K int8 records with a float32 scale per 16 inputs. Q5's 5-bit and Q6's
6-bit values take a byte each in the records (the kernel reads 4 or 8 bits).

Numerics: the kernel's arithmetic per output is fixed (the kernel's header says how), so a row's result does
not depend on the batch, its place in it, or the thread count: no row padding is needed, unlike the packed
oneDNN linears. Against a float32 product with the dequantized weights it differs only by float32 rounding;
activations stay in the model's dtype, so a bfloat16 model still rounds its activations to bfloat16
between ops as transformers does. Every CPU tier has the kernel (kernels/csrc/simd.h).

Where it applies: the model came from a GGUF (the converted directory names its source), the device is the
CPU, the dtype is bfloat16 or float32, and every part of a fused layer (q/k/v, gate/up) has one of the above
types (not necessarily the same one), with whole blocks per row. Any other layer keeps the dense path.
`brine serve --quantization none` (EngineConfig.quantization) turns it off: every layer is then dequantized to the model's dtype.
Which layers of a model become QuantLinears is the loader's business (`loading.quantize`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from engine.model.kernels.build import FLOAT32_BF16_CODES, Kernels

# GGML type ids (gguf.GGMLQuantizationType) the kernel runs, by name.
GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0 = 2, 3, 6, 7, 8
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 12, 13, 14
TYPE_NAMES = {
    GGML_Q4_0: "Q4_0",
    GGML_Q4_1: "Q4_1",
    GGML_Q5_0: "Q5_0",
    GGML_Q5_1: "Q5_1",
    GGML_Q8_0: "Q8_0",
    GGML_Q4_K: "Q4_K",
    GGML_Q5_K: "Q5_K",
    GGML_Q6_K: "Q6_K",
}
# Record kinds (the kernel's wtype bits): int8 q, a min per block, float32 scales, two scales per block.
_INT8, _MIN, _F32, _HALVES = 1, 2, 4, 8
# Not a record kind: the call quantizes x to Q8 per block and takes integer dot products (csrc/quant_q8.h).
Q8_ACTIVATIONS = 16
KERNEL_KIND = {
    GGML_Q4_0: _MIN,
    GGML_Q4_1: _MIN,
    GGML_Q5_0: _INT8,
    GGML_Q5_1: _INT8 | _MIN,
    GGML_Q8_0: _INT8,
    GGML_Q4_K: _MIN | _F32,
    GGML_Q5_K: _INT8 | _MIN | _F32,
    GGML_Q6_K: _INT8 | _F32 | _HALVES,
}
# (weights per GGUF block, bytes per block)
_GGUF_BLOCK = {
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    12: (256, 144),
    13: (256, 176),
}
_GGUF_BLOCK[14] = (256, 210)
TILE, BLOCK = 16, 32


def row_bytes(ggml_type: int, in_features: int) -> int:
    per, nbytes = _GGUF_BLOCK[ggml_type]
    return in_features // per * nbytes


def runs_as_stored(ggml_type: int | None, in_features: int) -> bool:
    """Whether the kernel runs a [*, in_features] tensor of this GGML type as stored."""
    return ggml_type in KERNEL_KIND and in_features % _GGUF_BLOCK[ggml_type][0] == 0


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: element j is byte j's low nibble, element j + 16 its high one."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes -> the 8 sub-blocks' 6-bit scales and mins (gguf-py's get_scale_min)."""
    d, m, m_d = (scales.reshape(*scales.shape[:-1], 3, 4)[..., i, :] for i in range(3))
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(raw: np.ndarray, ggml_type: int, in_features: int):
    """GGUF rows [n, bytes] -> (q [n, K] as the kernel reads it, d [n, K / 32], m or d1 [n, K / 32] or None),
    with w = d q + m exactly (two scales: d for inputs 0-15 of a block, d1 for 16-31). Scales stay float16
    where the kind has float16 scales (the file's bits), else float32 (exact products of the file's)."""
    n = raw.shape[0]
    per, nbytes = _GGUF_BLOCK[ggml_type]
    b = raw.reshape(n, in_features // per, nbytes)
    if ggml_type in (GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0):
        d = _f16(b[..., 0:2])
        if ggml_type == GGML_Q8_0:
            return b[..., 2:34].view(np.int8).reshape(n, in_features), d, None
        if ggml_type == GGML_Q4_0:
            q = _nibbles(b[..., 2:18])
            return q.reshape(n, in_features), d, (d * np.float16(-8)).astype(np.float16)
        if ggml_type == GGML_Q4_1:
            return _nibbles(b[..., 4:20]).reshape(n, in_features), d, _f16(b[..., 2:4])
        at = 2 if ggml_type == GGML_Q5_0 else 4
        qh = np.ascontiguousarray(b[..., at : at + 4]).view(np.uint32)  # [n, blocks, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = _nibbles(b[..., at + 4 : at + 20]) | (high << 4)
        if ggml_type == GGML_Q5_0:
            return (q.astype(np.int16) - 16).astype(np.int8).reshape(n, in_features), d, None
        return q.astype(np.int8).reshape(n, in_features), d, _f16(b[..., 2:4])
    if ggml_type in (GGML_Q4_K, GGML_Q5_K):
        d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
        sc, mn = _k_scales(b[..., 4:16])  # [n, supers, 8]
        qs = b[..., -128:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0xF).reshape(n, -1, 8, 32)
        if ggml_type == GGML_Q5_K:
            qh = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & 1) << 4)
        scale = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
        low = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
        return q.astype(np.int8 if ggml_type == GGML_Q5_K else np.uint8).reshape(n, in_features), scale, low
    # Q6_K: ql 128 | qh 64 | 16 int8 scales | d; value d * scale[j] * (q - 32) for the 16 inputs j of a scale
    ql = b[..., 0:128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    q = ((ql & 0xF).reshape(n, -1, 256) | ((qh & 3).reshape(n, -1, 256) << 4)).astype(np.int16) - 32
    sub = b[..., 192:208].view(np.int8).astype(np.float32)
    halves = (_f16(b[..., 208:210]).astype(np.float32)[..., None] * sub).reshape(n, -1, 2)
    # halves: [n, 32-input blocks, (inputs 0-15, 16-31)]
    return q.astype(np.int8).reshape(n, in_features), halves[..., 0], halves[..., 1]


# The 4-bit records' byte order (the kernel's unpacking): byte 64 j + 16 L + 8 h + k holds, for column
# 4 L + k // 2, input 2 (4 j + h) + k % 2 in its low nibble and input 2 (4 j + 2 + h) + k % 2 in its high one.
_POS = np.arange(256)
_J, _L, _H, _K = _POS // 64, _POS % 64 // 16, _POS % 16 // 8, _POS % 8
_COL = 4 * _L + _K // 2
_LOW_IN, _HIGH_IN = 2 * (4 * _J + _H) + _K % 2, 2 * (4 * _J + 2 + _H) + _K % 2


def records(ggml_type: int, q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """decode()'s arrays -> the kernel's records [tiles, blocks, record bytes] (its header). Output features
    are padded to a multiple of 16 with zero weights."""
    n, k = q.shape
    blocks, pad = k // BLOCK, -n % TILE
    if pad:
        q = np.concatenate([q, np.zeros((pad, k), q.dtype)])
        d = np.concatenate([d, np.zeros((pad, blocks), d.dtype)])
        m = None if m is None else np.concatenate([m, np.zeros((pad, blocks), m.dtype)])
    tiles = q.shape[0] // TILE

    def scales(s: np.ndarray) -> np.ndarray:  # [tiles * 16, blocks] -> [tiles, blocks, 16 x bytes]
        s = np.ascontiguousarray(s.reshape(tiles, TILE, blocks).transpose(0, 2, 1))
        return s.view(np.uint8).reshape(tiles, blocks, -1)

    parts = [scales(d)] + ([] if m is None else [scales(m)])
    qt = q.reshape(tiles, TILE, blocks, BLOCK).transpose(0, 2, 1, 3)  # [tiles, blocks, column, input]
    if KERNEL_KIND[ggml_type] & _INT8:
        pairs = qt.reshape(tiles, blocks, TILE, BLOCK // 2, 2).transpose(
            0, 1, 3, 2, 4
        )  # [.., pair, column, 2]
        parts.append(np.ascontiguousarray(pairs).view(np.uint8).reshape(tiles, blocks, BLOCK * TILE))
    else:
        qt = qt.astype(np.uint8)
        parts.append(qt[..., _COL, _LOW_IN] | (qt[..., _COL, _HIGH_IN] << 4))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


def repack(raw: np.ndarray, ggml_type: int, in_features: int) -> np.ndarray:
    """GGUF rows [out, bytes per row] -> the kernel's records [tiles, blocks, record bytes]."""
    return records(ggml_type, *decode(raw, ggml_type, in_features))


class QuantLinear(nn.Module):
    """y = x W^T (+ b) on GGUF blocks repacked for the kernel; a drop-in for the model's linears on [M, in].

    A fused layer may be made of parts of different types (a Q4_K_M file's Q4_K attn_q and attn_k beside a
    Q6_K attn_v): `QuantLinear.of_parts` gives each part its own records, and each kernel call writes its
    part's columns of the output (same arithmetic per column as one call: columns never mix).
    """

    fn: Callable[..., int]  # the kernel (ctypes)

    def __init__(
        self,
        kernels: Kernels,
        ggml_type: int,
        raw: np.ndarray,
        in_features: int,
        bias: torch.Tensor | None = None,
        *,
        q8_activations: bool = False,
    ) -> None:
        super().__init__()
        if kernels.quant_linear is None:
            raise ValueError("this CPU has no quantized-linear kernel")
        self.fn = kernels.quant_linear
        self.in_features, self.out_features = in_features, 0
        # x quantized to Q8 per block of 32 inputs, integer dot products (--quantize-activations q8)
        self.q8_activations = q8_activations
        # (GGML type, output features) per part, in column order; part i's records are buffer records_i
        self.parts: list[tuple[int, int]] = []
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._add(ggml_type, raw)

    @classmethod
    def of_parts(
        cls,
        kernels: Kernels,
        parts: list[tuple[int, np.ndarray]],
        in_features: int,
        bias: torch.Tensor | None = None,
        *,
        q8_activations: bool = False,
    ) -> QuantLinear:
        """One layer from [(GGML type, GGUF rows)] side by side in the output (at most 3 parts)."""
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"a quantized layer has 1 to 3 parts, got {len(parts)}")
        layer = cls(kernels, *parts[0], in_features, bias, q8_activations=q8_activations)
        for ggml_type, raw in parts[1:]:
            layer._add(ggml_type, raw)
        return layer

    def _add(self, ggml_type: int, raw: np.ndarray) -> None:
        if ggml_type not in KERNEL_KIND:
            raise ValueError(f"GGML type {ggml_type} has no kernel (runs: {', '.join(TYPE_NAMES.values())})")
        if not runs_as_stored(ggml_type, self.in_features):
            per = _GGUF_BLOCK[ggml_type][0]
            raise ValueError(
                f"in_features {self.in_features} is not a multiple of {per} ({TYPE_NAMES[ggml_type]})"
            )
        records = torch.from_numpy(repack(raw, ggml_type, self.in_features))
        self.register_buffer(f"records_{len(self.parts)}", records, persistent=False)
        self.parts.append((ggml_type, raw.shape[0]))
        self.out_features += raw.shape[0]

    def part_records(self) -> list[tuple[torch.Tensor, int, int]]:
        """(records, kernel wtype, output features) per part, in column order."""
        act = Q8_ACTIVATIONS if self.q8_activations else 0
        return [
            (getattr(self, f"records_{i}"), KERNEL_KIND[t] | act, n) for i, (t, n) in enumerate(self.parts)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        dtype = FLOAT32_BF16_CODES.get(x.dtype)
        if dtype is None or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"QuantLinear takes [M, {self.in_features}] float32 or bfloat16, got {x.dtype} {x.shape}"
            )
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=x.dtype)
        col = 0
        for records, wtype, n in self.part_records():
            rc = self.fn(
                wtype,
                records.data_ptr(),
                n,
                self.in_features,
                dtype,
                x.data_ptr(),
                m,
                self.in_features,
                None if self.bias is None else self.bias[col:].data_ptr(),
                out[:, col:].data_ptr(),
                self.out_features,
                dtype,
                torch.get_num_threads(),
            )
            if rc:
                raise RuntimeError(f"quantized linear kernel refused its arguments (code {rc})")
            col += n
        return out

    @property
    def ggml_type(self) -> int:  # the first part's
        return self.parts[0][0]

    @property
    def kind(self) -> str:  # "Q4_1", "Q4_K+Q6_K" for a layer of mixed parts, "Q4_1 x Q8" with Q8 activations
        names = dict.fromkeys(TYPE_NAMES[t] for t, _ in self.parts)
        return "+".join(names) + (" x Q8" if self.q8_activations else "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"
