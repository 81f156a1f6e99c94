"""A GGUF file's tensors (name, type, raw bytes) without decoding its metadata.

Why: gguf-py's `GGUFReader` builds a numpy view for every metadata item, and the default model's tokenizer
arrays (49,152 tokens, 48,900 merges) made it take about half of an engine start, every start. The quantized
linears need only the tensors (the conversion into $BRINE_CACHE read the metadata once), so this walks the
metadata by its lengths (GGUF v2/v3: little-endian; strings are a u64 length and bytes; arrays a u32 item type,
a u64 count and the items) and maps the tensor data read-only. tests/engine/test_gguf_tensors.py checks it
against `GGUFReader` tensor by tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
# Metadata value types (gguf-py's GGUFValueType) -> their size in bytes; STRING (8) and ARRAY (9) are walked.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_ALIGNMENT_KEY = "general.alignment"


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: int  # GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the innermost dimension first
    data: np.ndarray  # uint8, the tensor's bytes as stored (read-only view of the file)


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str:
        n = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", "surrogateescape")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.pos += _FIXED[vtype]
        elif vtype == _STRING:
            n = self.take("<Q")  # (not `self.pos += self.take(...)`: that reads pos before take moves it)
            self.pos += n
        elif vtype == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _FIXED:
                self.pos += _FIXED[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown GGUF metadata type {vtype} at byte {self.pos}")


def read_tensors(path: Path) -> dict[str, GGUFTensor]:
    """Every tensor of the GGUF file at `path`, by name. ValueError for a file that is not GGUF v2/v3 or is
    cut short."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # (block size, bytes per block) per type

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm.data))
    try:
        if bytes(cur.buf[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        alignment = 32
        for _ in range(n_kv):
            key, vtype = cur.string(), cur.take("<I")
            if key == _ALIGNMENT_KEY and vtype == 4:
                alignment = cur.take("<I")
            else:
                cur.skip_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.take("<I")
            shape = tuple(cur.take("<Q") for _ in range(n_dims))
            infos.append((name, shape, cur.take("<I"), cur.take("<Q")))
    except struct.error as exc:
        raise ValueError(f"{path}: GGUF header cut short ({exc})") from exc
    start = -(-cur.pos // alignment) * alignment
    out: dict[str, GGUFTensor] = {}
    for name, shape, ttype, offset in infos:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except ValueError as exc:
            raise ValueError(f"{path}: tensor {name} has unknown type {ttype}") from exc
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count // block * block_bytes
        at = start + offset
        if count % block or at + nbytes > mm.size:
            raise ValueError(f"{path}: tensor {name} ({shape}, type {ttype}) runs past the file")
        out[name] = GGUFTensor(name, ttype, shape, mm[at : at + nbytes])
    return out
