"""engine/model/gguf_tensors.py reads the same tensors as gguf-py's GGUFReader, byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.model.loading.files import default_gguf_path
from engine.model.loading.gguf_tensors import read_tensors


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    try:
        return default_gguf_path()
    except Exception as exc:  # the wheel is a test dependency; say so rather than fail obscurely
        pytest.skip(f"default GGUF not installed: {exc}")


def test_every_tensor_matches_gguf_py(gguf_file: Path) -> None:
    import gguf

    theirs = {t.name: t for t in gguf.GGUFReader(str(gguf_file)).tensors}
    ours = read_tensors(gguf_file)
    assert list(ours) == list(theirs) and len(ours) > 100
    for name, t in theirs.items():
        mine = ours[name]
        assert mine.tensor_type == int(t.tensor_type), name
        assert mine.shape == tuple(int(d) for d in t.shape), name
        assert np.array_equal(mine.data, np.asarray(t.data).reshape(-1).view(np.uint8)), name


def test_a_cut_or_foreign_file_is_a_clear_error(gguf_file: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:200_000])  # inside the metadata or the tensor data
    with pytest.raises(ValueError, match="cut short|runs past"):
        read_tensors(cut)
    other = tmp_path / "x.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensors(other)
